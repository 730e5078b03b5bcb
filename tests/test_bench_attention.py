"""`scripts/bench attention`: a row of timings per step asked for, a column per cache format;
bad rows and formats refused by the parser with the form it wants."""

from __future__ import annotations

import pytest
from kernel_marks import needs_kernels

from pipeline.tools.bench import main


@needs_kernels
def test_a_row_per_step_and_a_column_per_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attention", "--rows", "1x20,3x40", "--cache", "bf16,int8,fp8_e5m2",
                 "--layers", "2", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "3 KV heads of 64, block 16, 2 caches in turn" in lines[0]
    assert lines[1].split() == ["decodes", "x", "position", "bf16", "int8", "fp8_e5m2"]
    rows = [line.split() for line in lines[2:]]
    assert [r[:3] for r in rows] == [["1", "x", "20"], ["3", "x", "40"]]
    assert all(float(us) > 0 for r in rows for us in r[3:]) and all(len(r) == 6 for r in rows)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--rows", "32by1024", "a row is DECODESxPOSITION"),
    ("--rows", "0x10", "at least one decode"),
    ("--cache", "bf16,int4", "'int4': the formats are bf16, int8, fp8_e4m3, fp8_e5m2"),
])
def test_bad_rows_and_formats_are_refused(flag: str, value: str, says: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["attention", flag, value])
    assert says in capsys.readouterr().err

"""The executor's forward backends: one file each (cpu_kernels, flex, torch_sdpa) behind the
interface of base.py; select.py says which runs, and why. Executor process only (select.py
also in the launcher's pre-flight check, without torch)."""

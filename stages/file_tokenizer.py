"""The model's tokenizer.json through the `tokenizers` library, with tokenizer_config.json's
special tokens and chat template: what transformers' own generic fast tokenizer
(`TokenizersBackend`, `PreTrainedTokenizerFast`) is, without importing transformers' package
root, which imports torch (~2.6 s and ~200 MB in every tokenizer process; loading the file
this way takes ~0.1 s). Runs in the tokenizer stage.

Only folders whose tokenizer_config.json names one of those generic classes are read here:
transformers' model-specific classes may rebuild the backend (a BOS added by the class, a
legacy normalizer), so for them `load_tokenizer` uses AutoTokenizer as before."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# tokenizer_config.json's classes that wrap tokenizer.json as it is.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")

# transformers' clean_up_tokenization: the spaces a word-level tokenizer left before these.
CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template as transformers finds it: template files take priority
    (chat_template.jinja as "default", additional_chat_templates/NAME.jinja), then
    tokenizer_config.json's entry (one template, or named ones as [{"name", "template"}])."""
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files |= {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))}
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template if isinstance(template, str) else None


class FileTokenizer:
    """The subset of a transformers fast tokenizer the tokenizer stage and the front end's
    /tokenize and /detokenize use: calling it on text, `decode`, `chat_template`,
    `apply_chat_template(..., tokenize=False)`, `eos_token_id`, and the backend's JSON for
    llguidance (`backend_json`)."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        from tokenizers import AddedToken, Tokenizer

        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # Added tokens the config lists and tokenizer.json lacks (transformers adds them too).
        vocab = self.backend.get_vocab(with_added_tokens=True)
        missing = [(int(i), t) for i, t in config.get("added_tokens_decoder", {}).items()
                   if t.get("content") not in vocab]
        for _, t in sorted(missing, key=lambda item: item[0]):
            token = AddedToken(t["content"], single_word=t.get("single_word", False),
                               lstrip=t.get("lstrip", False), rstrip=t.get("rstrip", False),
                               normalized=t.get("normalized", False),
                               special=t.get("special", True))
            if token.special:
                self.backend.add_special_tokens([token])
            else:
                self.backend.add_tokens([token])
        self.special_tokens_map = {name: value for name in SPECIAL_TOKENS
                                   if (value := _content(config.get(name))) is not None}
        self.chat_template = _chat_template(folder, config)
        # (transformers skips the clean-up for BPE, which it would corrupt, unless forced.)
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self.backend.model).__name__ != "BPE" or bool(config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if eos is not None else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text,
                                                 add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """As transformers decodes (its clean-up of spaces before punctuation where the
        config asks for it)."""
        text = str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))
        if self.clean_up_spaces:
            for spaced, tight in CLEAN_UP:
                text = text.replace(spaced, tight)
        return text

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """The conversation rendered by transformers' own Jinja environment (its module
        imports no torch), with the special tokens as template variables, as transformers
        renders it; kwargs: the template's extra variables (a request's
        chat_template_kwargs)."""
        if tokenize:
            raise ValueError("FileTokenizer renders text only (tokenize=False)")
        template = self.chat_template
        if isinstance(template, dict):  # transformers' choice among named templates
            template = template.get("tool_use" if tools and "tool_use" in template
                                     else "default")
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[conversation], tools=tools, chat_template=template,
            add_generation_prompt=add_generation_prompt, **self.special_tokens_map, **kwargs)
        return str(rendered[0])

    def backend_json(self) -> str:
        """tokenizer.json as loaded, added tokens included (what llguidance reads)."""
        return str(self.backend.to_str())


def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer: a FileTokenizer where tokenizer_config.json names a generic
    fast class and tokenizer.json exists, transformers' AutoTokenizer otherwise."""
    folder = Path(model_dir)
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") in GENERIC_CLASSES and (folder / "tokenizer.json").is_file():
        return FileTokenizer(folder, config)
    import transformers
    from transformers import AutoTokenizer

    logger.info("tokenizer class %s: loaded through transformers",
                config.get("tokenizer_class"))
    if not logger.isEnabledFor(logging.DEBUG):
        # Its warning that a prompt is longer than the model's context would show for a
        # prompt this stage refuses anyway, with a clear error.
        transformers.logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(model_dir)

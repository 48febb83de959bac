"""The prompt sets of the served evaluation, and how a turn's prompt is formed.

Owns reading a set into prompt records: MT-Bench, HumanEval and GSM8K from their installed data
packages (core.assets), GSM8K and HumanEval turns wrapped in their instruction as the DFlash
paper's benchmark wraps them, or a JSONL file of {"turns": [...]} records (optional "id", and
"system": a system message); a set's name in results; and a conversation's prompt ids: the
target's chat template with the generation prompt (no system prompt unless a record gives one).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_train.core import assets
from dflash_train.core.config import PROMPT_SETS
from dflash_train.core.errors import InputError

GSM8K_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:\n"


# --------------------------------------------------------------------------- prompt sets


@dataclass
class PromptRecord:
    id: str
    turns: list[str]
    """User turns, already wrapped in the set's instruction."""
    system: str | None = None
    """A system message before the first turn (a prompts file's "system"); None: the template's
    default."""

    def first_messages(self) -> list[dict[str, str]]:
        """The conversation up to the first turn: the system message (if any), the first turn."""
        opening = [{"role": "system", "content": self.system}] if self.system is not None else []
        return opening + [{"role": "user", "content": self.turns[0]}]


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise InputError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        except UnicodeDecodeError as err:
            raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start} of a line); give a JSONL "
                             f"file of {{\"turns\": [...]}} records") from err
    return rows


def gsm8k_turn(question: str) -> str:
    return question + GSM8K_INSTRUCTION


def humaneval_turn(prompt: str) -> str:
    return f"{HUMANEVAL_INSTRUCTION}```python\n{prompt}\n```"


def load_prompts(name_or_file: str, limit: int | None = None) -> list[PromptRecord]:
    """The records of a prompt set (`mt-bench`, `humaneval`, `gsm8k`) or of a JSONL file of
    {"turns": [str, ...]} records (optional "id", and "system": a system message); the first
    `limit` of them."""
    if name_or_file == "mt-bench":
        rows = _read_jsonl(assets.mtbench_jsonl())
        records = [PromptRecord(str(r["question_id"]), list(r["turns"])) for r in rows]
    elif name_or_file == "humaneval":
        rows = _read_jsonl(assets.humaneval_jsonl_gz())
        records = [PromptRecord(r["task_id"], [humaneval_turn(r["prompt"])]) for r in rows]
    elif name_or_file == "gsm8k":
        rows = _read_jsonl(assets.gsm8k_jsonl())
        records = [PromptRecord(f"gsm8k/{i}", [gsm8k_turn(r["question"])]) for i, r in enumerate(rows)]
    else:
        path = Path(name_or_file)
        if not path.is_file():
            raise InputError(f"prompts {name_or_file!r}: not one of {', '.join(PROMPT_SETS)} and not a file")
        records = []
        for i, r in enumerate(_read_jsonl(path)):
            turns = r.get("turns") if isinstance(r, dict) else None
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise InputError(f"{path}: record {i + 1} needs \"turns\": a non-empty list of strings")
            system = r.get("system")
            if system is not None and not isinstance(system, str):
                raise InputError(f"{path}: record {i + 1}: \"system\" must be a string (or left out)")
            records.append(PromptRecord(str(r.get("id", i)), turns, system))
    if limit is not None:
        records = records[:limit]
    if not records:
        what = "--limit leaves none" if limit is not None else "an empty file?"
        raise InputError(f"prompts {name_or_file!r}: no records ({what})")
    return records


def set_label(name_or_file: str) -> str:
    """How a set is named in results: the set name, or the file's stem."""
    return name_or_file if name_or_file in PROMPT_SETS else Path(name_or_file).stem


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ending with a user turn, rendered by the target's chat
    template with the generation prompt (the template adds any special tokens it wants)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

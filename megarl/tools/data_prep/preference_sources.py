"""Preference pairs from public formats and from GSM-Symbolic, in the schema PreferenceDataset reads.

Every pair becomes one row:

- `prompt`: the conversation before the compared turn, as chat messages (role, content);
- `chosen`, `rejected`: the two final assistant replies, as strings;
- `data_source`, `ground_truth` (a string, or null when there is none), and
  `extra_info` = {split, index, origin}.

Sources:

- hh-rlhf (Anthropic/hh-rlhf): `chosen` and `rejected` are whole transcripts
  "\\n\\nHuman: ...\\n\\nAssistant: ...". Both must share every turn but the last, which must be
  the assistant's; the shared turns are the prompt.
- ultrafeedback (HuggingFaceH4/ultrafeedback_binarized, splits train_prefs/test_prefs): a `prompt`
  column (string or messages) and `chosen`/`rejected` as message lists holding the whole
  conversation (prompt turns + reply) or only the reply, or as reply strings. The project's own
  output files have this shape too, so they read back as a local source.
- synthetic-gsm: GSM-Symbolic problems (see megarl.tools.data_prep.common) with a chosen reply ending in the
  correct '#### <answer>' and a rejected one that megarl.rewards.gsm8k scores 0:
  * default ("wrong-final"): both replies carry the same worked reasoning; the rejected one's
    final line gives the answer off by a small offset with the same number of digits, so both
    replies have the same length and differ only in that number: a model has to check the
    final line against the reasoning's last result.
  * easy ("filler"): the chosen reply is a short "The answer is N.\\n#### N", the rejected one
    a short non-answer ("I don't know."), different in surface form.

Rows that are well-typed but cannot make a pair (different earlier turns, empty or identical
replies, a transcript without turns) are dropped and counted by reason; wrong column types
and missing columns are errors that name the record and the fix.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final, Literal

import pyarrow as pa

from megarl.data.chat import to_messages
from megarl.data.errors import DataError
from megarl.tools.data_prep.common import (
    GSM8K_DATA_SOURCE,
    GSM8K_INSTRUCTION,
    PrepareError,
    SymbolicProblem,
    has_record_suffix,
    iter_symbolic_problems,
    read_records,
    subsample,
)

Messages = list[dict[str, str]]
Format = Literal["hh-rlhf", "ultrafeedback"]
RecordGroup = tuple[str, list[dict[str, object]]]  # (origin, records)

HH_RLHF: Final = "hh-rlhf"
ULTRAFEEDBACK: Final = "ultrafeedback"
SYNTHETIC_GSM: Final = "synthetic-gsm"
SOURCES = (HH_RLHF, ULTRAFEEDBACK, SYNTHETIC_GSM)
HUB_REPOS = {HH_RLHF: "Anthropic/hh-rlhf", ULTRAFEEDBACK: "HuggingFaceH4/ultrafeedback_binarized"}
HUB_SPLITS = {
    HH_RLHF: {"train": "train", "test": "test"},
    ULTRAFEEDBACK: {"train": "train_prefs", "test": "test_prefs"},
}
# The four folders that load_dataset("Anthropic/hh-rlhf") combines (red-team-attempts has no pairs).
HH_RLHF_SUBSETS = ("harmless-base", "helpful-base", "helpful-online", "helpful-rejection-sampled")
SYNTHETIC_SIZES = {"train": 2000, "test": 200}
EASY_FILLERS = (
    "I don't know.",
    "I'm not sure, sorry.",
    "I can't work this one out.",
    "No idea, sorry.",
    "Hard to say. I don't know.",
)
ASCII_CHARS = frozenset(string.printable[:95] + "\n")  # printable ASCII, space and newline
ALTERNATIVES = (
    "without a reachable hub, pass a local file or folder of pairs as --source PATH, or use "
    "--source synthetic-gsm (offline)"
)

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
PREFERENCE_SCHEMA = pa.schema(
    [
        ("prompt", pa.list_(MESSAGE_TYPE)),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
        ("data_source", pa.string()),
        ("ground_truth", pa.string()),
        (
            "extra_info",
            pa.struct([("split", pa.string()), ("index", pa.int64()), ("origin", pa.string())]),
        ),
    ]
)


@dataclass
class PreferencePair:
    """One comparison: the prompt messages and the two replies to it."""

    prompt: Messages
    chosen: str
    rejected: str
    data_source: str
    ground_truth: str | None = None
    origin: str = ""

    @property
    def chars(self) -> int:
        """Characters of the prompt's contents plus the longer reply."""
        return sum(len(m["content"]) for m in self.prompt) + max(
            len(self.chosen), len(self.rejected)
        )

    def to_row(self, split: str, index: int) -> dict[str, object]:
        return {
            "prompt": [{"role": m["role"], "content": m["content"]} for m in self.prompt],
            "chosen": self.chosen,
            "rejected": self.rejected,
            "data_source": self.data_source,
            "ground_truth": self.ground_truth,
            "extra_info": {"split": split, "index": index, "origin": self.origin},
        }


def pairs_table(pairs: Sequence[PreferencePair], split: str) -> pa.Table:
    """The pairs as a table in PREFERENCE_SCHEMA, indexed in order."""
    return pa.Table.from_pylist(
        [p.to_row(split, i) for i, p in enumerate(pairs)], schema=PREFERENCE_SCHEMA
    )


@dataclass(frozen=True)
class PairFilter:
    """Which pairs to keep: at most `max_chars` characters (prompt contents + the longer reply),
    and with `ascii_only` only printable ASCII and newlines (what the tiny character tokenizer
    of megarl.tools.testing.assets covers)."""

    max_chars: int | None = None
    ascii_only: bool = False

    def reason(self, pair: PreferencePair) -> str | None:
        """Why the pair is dropped, or None to keep it."""
        if self.max_chars is not None and pair.chars > self.max_chars:
            return f"over --max-chars {self.max_chars}"
        if self.ascii_only:
            texts = [m["content"] for m in pair.prompt] + [pair.chosen, pair.rejected]
            if any(not ASCII_CHARS.issuperset(t) for t in texts):
                return "not printable ASCII (--ascii-only)"
        return None


class _Skip(Exception):
    """A well-typed record that makes no usable pair; the message is the reason, counted."""


# ---------------------------------------------------------------------------------------------
# Conversations -> (prompt, chosen, rejected)


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_hh_transcript(text: str) -> Messages:
    """'\\n\\nHuman: ...\\n\\nAssistant: ...' as messages (user/assistant, contents stripped)."""
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    parts = _HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise _Skip("not a '\\n\\nHuman: ... \\n\\nAssistant: ...' transcript")
    return [
        {"role": _HH_ROLES[role], "content": content.strip()}
        for role, content in zip(parts[1::2], parts[2::2], strict=True)
    ]


def split_conversations(chosen: Messages, rejected: Messages) -> tuple[Messages, str, str]:
    """(prompt, chosen reply, rejected reply) of two conversations that share all turns but their
    last, an assistant reply each."""
    if not chosen or not rejected:
        raise _Skip("empty conversation")
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise _Skip("a conversation does not end with an assistant turn")
    prompt = chosen[:-1]
    if rejected[:-1] != prompt:
        raise _Skip("chosen and rejected differ before their last turn")
    if not prompt or prompt[-1]["role"] != "user":
        raise _Skip("the prompt does not end with a user turn")
    c, r = chosen[-1]["content"], rejected[-1]["content"]
    if not c.strip() or not r.strip():
        raise _Skip("empty reply")
    if c == r:
        raise _Skip("identical replies")
    return prompt, c, r


def _messages(value: object, where: str, column: str, role: str) -> Messages:
    try:
        messages = to_messages(value, where=where, column=column, role=role)
    except DataError as e:
        raise PrepareError(str(e)) from e
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _string(record: dict[str, object], column: str, where: str, fmt: str) -> str:
    value = record.get(column)
    if not isinstance(value, str):
        raise PrepareError(
            f"{where}: column '{column}' is {type(value).__name__}, not a string; {fmt} rows "
            "hold whole transcripts as strings (use a 'prompt' column for message lists)."
        )
    return value


def hh_rlhf_pair(record: dict[str, object], where: str) -> tuple[Messages, str, str]:
    """The pair in an hh-rlhf row ({'chosen': transcript, 'rejected': transcript})."""
    chosen = parse_hh_transcript(_string(record, "chosen", where, HH_RLHF))
    rejected = parse_hh_transcript(_string(record, "rejected", where, HH_RLHF))
    return split_conversations(chosen, rejected)


def ultrafeedback_pair(record: dict[str, object], where: str) -> tuple[Messages, str, str]:
    """The pair in a prompt/chosen/rejected row: replies as strings, as message lists of the
    reply alone, or as whole conversations starting with the prompt's turns."""
    chosen = _messages(record.get("chosen"), where, "chosen", "assistant")
    rejected = _messages(record.get("rejected"), where, "rejected", "assistant")
    prompt = _messages(record.get("prompt"), where, "prompt", "user")
    if any(m["role"] != "assistant" for m in chosen + rejected):
        conv_prompt, c, r = split_conversations(chosen, rejected)
        if [m["content"].strip() for m in conv_prompt[-len(prompt) :]] != [
            m["content"].strip() for m in prompt
        ]:
            raise _Skip("the prompt column differs from the conversation's prompt turns")
        return conv_prompt, c, r
    if len(chosen) != 1 or len(rejected) != 1:
        raise _Skip("a reply is more than one assistant message")
    return split_conversations(prompt + chosen, prompt + rejected)


_CONVERTERS: dict[str, Callable[[dict[str, object], str], tuple[Messages, str, str]]] = {
    HH_RLHF: hh_rlhf_pair,
    ULTRAFEEDBACK: ultrafeedback_pair,
}


def detect_format(columns: Iterable[str], where: str) -> Format:
    """'ultrafeedback' with a prompt column, 'hh-rlhf' with only chosen and rejected."""
    names = set(columns)
    missing = {"chosen", "rejected"} - names
    if missing:
        raise PrepareError(
            f"{where}: no column {', '.join(repr(c) for c in sorted(missing))}; the columns are "
            f"{sorted(names)}. A preference file needs 'chosen' and 'rejected' (hh-rlhf "
            "transcripts), plus 'prompt' for prompt/chosen/rejected rows (ultrafeedback style)."
        )
    return ULTRAFEEDBACK if "prompt" in names else HH_RLHF


def convert_records(
    records: Sequence[dict[str, object]],
    *,
    origin: str,
    fmt: Format | None = None,
    pair_filter: PairFilter | None = None,
    dropped: Counter[str] | None = None,
) -> list[PreferencePair]:
    """The pairs in `records` (format detected from the columns unless given); rows that make
    no pair or fail the filter are counted in `dropped` by reason."""
    dropped = Counter() if dropped is None else dropped
    if not records:
        return []
    if fmt is None:
        fmt = detect_format({k for rec in records for k in rec}, origin)
    convert = _CONVERTERS[fmt]
    required = ("prompt", "chosen", "rejected") if fmt == ULTRAFEEDBACK else ("chosen", "rejected")
    pairs = []
    for i, rec in enumerate(records):
        where = f"{origin}: record {i}"
        for column in required:
            if rec.get(column) is None:
                raise PrepareError(
                    f"{where}: column '{column}' is missing or null ({fmt} rows need "
                    f"{', '.join(required)}); fill or remove the row."
                )
        try:
            prompt, chosen, rejected = convert(rec, where)
        except _Skip as e:
            dropped[str(e)] += 1
            continue
        data_source = rec.get("data_source")
        truth = rec.get("ground_truth")
        pair = PreferencePair(
            prompt=prompt,
            chosen=chosen,
            rejected=rejected,
            data_source=data_source if isinstance(data_source, str) else HUB_REPOS[fmt],
            ground_truth=None if truth is None else str(truth),
            origin=origin,
        )
        reason = pair_filter.reason(pair) if pair_filter else None
        if reason:
            dropped[reason] += 1
            continue
        pairs.append(pair)
    return pairs


# ---------------------------------------------------------------------------------------------
# Synthetic GSM pairs


def wrong_answer(answer: int, rng: random.Random) -> int:
    """`answer` off by 1-3, with as many characters and, for a non-negative answer, not negative."""
    width = len(str(answer))
    options = [
        answer + d
        for d in (-3, -2, -1, 1, 2, 3)
        if len(str(answer + d)) == width and (answer < 0 or answer + d >= 0)
    ]
    return rng.choice(options)


def gsm_pair(problem: SymbolicProblem, *, seed: int, split: str, easy: bool) -> PreferencePair:
    """A pair for one problem: see the module docstring for the two kinds."""
    rng = random.Random(f"synthetic-gsm/{seed}/{split}/{problem.attempt}")
    truth = str(problem.answer)
    if easy:
        chosen, rejected, kind = (
            f"The answer is {truth}.\n#### {truth}",
            rng.choice(EASY_FILLERS),
            "filler",
        )
    else:
        head = f"{problem.reasoning}\n" if problem.reasoning else ""
        wrong = wrong_answer(problem.answer, rng)
        chosen, rejected, kind = f"{head}#### {truth}", f"{head}#### {wrong}", "wrong-final"
    return PreferencePair(
        prompt=[{"role": "user", "content": f"{problem.question.strip()} {GSM8K_INSTRUCTION}"}],
        chosen=chosen,
        rejected=rejected,
        data_source=GSM8K_DATA_SOURCE,
        ground_truth=truth,
        origin=f"gsm-symbolic/{problem.template}:{kind}",
    )


def synthetic_gsm_pairs(
    n: int,
    seed: int,
    split: str,
    *,
    easy: bool = False,
    pair_filter: PairFilter | None = None,
    dropped: Counter[str] | None = None,
) -> list[PreferencePair]:
    """`n` GSM-Symbolic pairs that pass the filter (train and test use disjoint templates)."""
    dropped = Counter() if dropped is None else dropped
    max_attempts = 20 * n + 200
    pairs: list[PreferencePair] = []
    for problem in iter_symbolic_problems(seed, split, max_attempts):
        pair = gsm_pair(problem, seed=seed, split=split, easy=easy)
        reason = pair_filter.reason(pair) if pair_filter else None
        if reason:
            dropped[reason] += 1
            continue
        pairs.append(pair)
        if len(pairs) == n:
            return pairs
    raise PrepareError(
        f"{SYNTHETIC_GSM}: only {len(pairs)} of {n} {split} pairs from {max_attempts} generated "
        f"problems (dropped: {describe_drops(dropped)}); raise --max-chars, drop --ascii-only, "
        f"or ask for fewer rows (--{split}-size)."
    )


# ---------------------------------------------------------------------------------------------
# Loading: the hub and local files


def _hub_records_datasets(datasets: ModuleType, repo: str, hub_split: str) -> list[RecordGroup]:
    ds = datasets.load_dataset(repo, split=hub_split)
    keep = [c for c in ("prompt", "chosen", "rejected") if c in ds.column_names]
    return [(f"{repo}[{hub_split}]", ds.select_columns(keep).to_list())]


def _hub_records_files(
    hub: ModuleType, source: str, repo: str, hub_split: str
) -> list[RecordGroup]:
    if source == HH_RLHF:
        files = [f"{subset}/{hub_split}.jsonl.gz" for subset in HH_RLHF_SUBSETS]
    else:
        files = sorted(
            f
            for f in hub.list_repo_files(repo, repo_type="dataset")
            if f.startswith(f"data/{hub_split}-") and f.endswith(".parquet")
        )
        if not files:
            raise PrepareError(f"{repo}: the hub repository has no data/{hub_split}-*.parquet.")
    groups = []
    for name in files:
        local = Path(hub.hf_hub_download(repo, name, repo_type="dataset"))
        groups.append((f"{repo}/{name}", read_records(local)))
    return groups


def load_hub(source: str, split: str) -> list[RecordGroup]:
    """One split of hh-rlhf or ultrafeedback from the Hugging Face hub: through `datasets` when
    installed, else through `huggingface_hub` downloads of the repository's files."""
    repo, hub_split = HUB_REPOS[source], HUB_SPLITS[source][split]
    try:
        import datasets
    except ImportError:
        datasets = None
    hub: Any = None
    if datasets is None:
        try:
            import huggingface_hub as hub
        except ImportError as e:
            raise PrepareError(
                f"--source {source} needs the `datasets` or `huggingface_hub` package to reach "
                f"the hub; {ALTERNATIVES}."
            ) from e
    try:
        if datasets is not None:
            return _hub_records_datasets(datasets, repo, hub_split)
        return _hub_records_files(hub, source, repo, hub_split)
    except PrepareError:
        raise
    except Exception as e:
        raise PrepareError(
            f"--source {source}: could not load {repo} [{hub_split}] from the hub "
            f"({type(e).__name__}: {str(e)[:200]}); {ALTERNATIVES}."
        ) from e


def local_groups(root: Path) -> dict[str, list[RecordGroup]] | list[RecordGroup]:
    """A file's records as one group (to be split), or a folder's train*/test* files by split
    (ultrafeedback's train_prefs*/test_prefs* preferred where present)."""
    if root.is_file():
        return [(str(root), read_records(root))]
    files = sorted(p for p in root.rglob("*") if p.is_file() and has_record_suffix(p))
    out: dict[str, list[RecordGroup]] = {}
    for split in ("train", "test"):
        matches = [p for p in files if p.name.startswith(f"{split}_prefs")] or [
            p for p in files if p.name.startswith(split)
        ]
        if not matches:
            raise PrepareError(
                f"--source {root}: no {split}*.parquet|jsonl|json file in the folder; name the "
                "files train*/test*, or pass one file (it is split into train and test)."
            )
        out[split] = [(str(p), read_records(p)) for p in matches]
    return out


# ---------------------------------------------------------------------------------------------
# Putting it together


@dataclass
class SplitResult:
    """One split's pairs and how they were obtained."""

    pairs: list[PreferencePair]
    origins: list[str] = field(default_factory=list)
    available: int = 0  # pairs left after conversion and filtering, before subsampling
    dropped: Counter[str] = field(default_factory=Counter)


def describe_drops(dropped: Counter[str]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in dropped.most_common()) or "none"


def _from_groups(
    groups: list[RecordGroup], fmt: Format | None, pair_filter: PairFilter
) -> SplitResult:
    result = SplitResult(pairs=[], origins=[origin for origin, _ in groups])
    for origin, records in groups:
        result.pairs += convert_records(
            records, origin=origin, fmt=fmt, pair_filter=pair_filter, dropped=result.dropped
        )
    result.available = len(result.pairs)
    return result


def _require_pairs(result: SplitResult, split: str, source: str, pair_filter: PairFilter) -> None:
    if result.pairs:
        return
    fixes = []
    if pair_filter.max_chars is not None:
        fixes.append("raise --max-chars")
    if pair_filter.ascii_only:
        fixes.append("drop --ascii-only")
    fixes.append("check that the rows hold pairs")
    raise PrepareError(
        f"--source {source}: no {split} pairs left (dropped: {describe_drops(result.dropped)}); "
        f"{', '.join(fixes)}."
    )


def build_splits(
    source: str,
    *,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    easy: bool = False,
    pair_filter: PairFilter | None = None,
) -> dict[str, SplitResult]:
    """The train and test pairs of a source: 'hh-rlhf', 'ultrafeedback' (hub), 'synthetic-gsm'
    (offline), or a local file (split into train and test: --test-size rows, default 5%) or
    folder (train*/test* files)."""
    pair_filter = pair_filter or PairFilter()
    sizes = {"train": train_size, "test": test_size}
    for split, value in sizes.items():
        if value is not None and value < 1:
            raise PrepareError(f"--{split}-size must be >= 1, got {value}.")
    if pair_filter.max_chars is not None and pair_filter.max_chars < 1:
        raise PrepareError(f"--max-chars must be >= 1, got {pair_filter.max_chars}.")
    if easy and source != SYNTHETIC_GSM:
        raise PrepareError(f"--easy applies to --source {SYNTHETIC_GSM} only.")
    if source == SYNTHETIC_GSM:
        out = {}
        for split, size in sizes.items():
            dropped: Counter[str] = Counter()
            pairs = synthetic_gsm_pairs(
                size or SYNTHETIC_SIZES[split],
                seed,
                split,
                easy=easy,
                pair_filter=pair_filter,
                dropped=dropped,
            )
            out[split] = SplitResult(pairs, ["reasoning-gym gsm_symbolic"], len(pairs), dropped)
        return out
    if source in HUB_REPOS:
        fmt: Format = HH_RLHF if source == HH_RLHF else ULTRAFEEDBACK
        out = {split: _from_groups(load_hub(source, split), fmt, pair_filter) for split in sizes}
    else:
        root = Path(source)
        if not root.exists():
            raise PrepareError(
                f"--source {source}: not one of {', '.join(SOURCES)} and no such file or folder."
            )
        groups = local_groups(root)
        if isinstance(groups, dict):
            out = {split: _from_groups(groups[split], None, pair_filter) for split in sizes}
        else:
            out = _split_one_file(_from_groups(groups, None, pair_filter), test_size, seed)
    for split, result in out.items():
        _require_pairs(result, split, source, pair_filter)
        result.pairs = subsample(result.pairs, sizes[split], seed, split)
    return out


def _split_one_file(whole: SplitResult, test_size: int | None, seed: int) -> dict[str, SplitResult]:
    n = len(whole.pairs)
    if n == 1:
        raise PrepareError(
            f"{whole.origins[0]}: one pair only; train and test need at least one each."
        )
    k = test_size if test_size is not None else max(1, round(0.05 * n))
    if n and k >= n:
        raise PrepareError(
            f"{whole.origins[0]}: --test-size {k} leaves no training pairs of {n}; ask for fewer."
        )
    order = list(range(n))
    random.Random(f"{seed}/holdout").shuffle(order)
    test_idx = set(order[:k])
    out = {}
    for split, keep in (("train", False), ("test", True)):
        pairs = [p for i, p in enumerate(whole.pairs) if (i in test_idx) == keep]
        out[split] = SplitResult(pairs, whole.origins, len(pairs), whole.dropped)
    return out

"""`pdfleet router --workers-file FILE`: the worker list as a JSON file re-read every discovery round, so `pdfleet up`
adds and removes workers by rewriting it. No torch."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdfleet_worker.router import engines
from pdfleet_worker.router.discovery import Source, make_source
from pdfleet_worker.router.tiers import DEFAULT_TIER, split_tier

# File key -> the role the router gives its workers (the keys are the router's flags).
ROLE_OF_KEY = {"prefill": "prefill", "decode": "decode", "workers": "both"}
KEY_OF_ROLE = {role: key for key, role in ROLE_OF_KEY.items()}


def entry(url: str, tier: str = DEFAULT_TIER, engine: str = engines.PDFLEET) -> str:
    """The `[TIER=][ENGINE@]URL` string for one worker, as the flags and the file take it."""
    engines.check(engine)
    return (f"{tier}=" if tier != DEFAULT_TIER else "") + (f"{engine}@" if engine != engines.PDFLEET else "") + url


def read(path: str | os.PathLike) -> dict[str, list[str]]:
    """{"prefill": [...], "decode": [...], "workers": [...]} as in the file (entries `[TIER=][ENGINE@]URL`, like
    the flags); ValueError naming the file and what is wrong with it."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"workers file {path}: {e.strerror or e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"workers file {path}: not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"workers file {path}: expected an object with keys {sorted(ROLE_OF_KEY)}, got {type(raw).__name__}"
        )
    unknown = sorted(set(raw) - set(ROLE_OF_KEY))
    if unknown:
        raise ValueError(f"workers file {path}: unknown keys {unknown}; known: {sorted(ROLE_OF_KEY)}")
    for key, values in raw.items():
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"workers file {path}: {key} must be a list of URLs")
        for value in values:
            try:
                engines.split_engine(split_tier(value)[1])
            except ValueError as e:
                raise ValueError(f"workers file {path}: {key}: {e}") from None
    return {key: list(values) for key, values in raw.items()}


def write(path: str | os.PathLike, entries: Mapping[str, Sequence[str]]) -> None:
    """Replace the file atomically (a router reading it never sees half a list)."""
    unknown = sorted(set(entries) - set(ROLE_OF_KEY))
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(ROLE_OF_KEY)}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({key: list(values) for key, values in entries.items()}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class WorkersFile(Source):
    """The workers of one engine that one (tier, role) has in the file now; each URL resolved as
    `--discovery` says. Entries that name no engine have `default_engine` (the router's --engine).

    A file that cannot be read raises OSError, so the router keeps the last set it knew; so does a
    file that puts a worker of another engine than the tier's in a prefill or decode pool (`engine` is
    the tier's prefill/decode engine there, as the file's first read gave it).
    """

    def __init__(
        self,
        path: str,
        tier: str,
        role: str,
        mode: str = "auto",
        engine: str = engines.PDFLEET,
        default_engine: str = engines.PDFLEET,
    ):
        super().__init__(f"file:{path}#{KEY_OF_ROLE[role]}", engines.check(engine))
        self.path, self.tier, self.key = path, tier, KEY_OF_ROLE[role]
        self.default_engine = engines.check(default_engine)
        # NOTE: EndpointSlices name Services, not workers; the file's URLs are resolved as DNS would.
        self.mode = mode if mode in ("static", "dns") else "auto"

    def resolve(self) -> set[str]:
        try:
            entries = read(self.path)
        except ValueError as e:
            raise OSError(str(e)) from None
        out: set[str] = set()
        for value in entries.get(self.key, []):
            tier, rest = split_tier(value)
            engine, url = engines.split_engine(rest, self.default_engine)
            if tier != self.tier:
                continue
            if engine != self.engine and self.key != KEY_OF_ROLE["both"]:
                raise OSError(
                    f"workers file {self.path}: {self.key}: tier {tier!r}'s prefill and decode workers "
                    f"run {self.engine} (one engine moves the KV); {engine}@{url} cannot join them"
                )
            if engine == self.engine:
                out |= make_source(url.rstrip("/"), self.mode).resolve()
        return out

"""An on-disk cache of plans, so that planning the same step twice skips the solver.

    optimize(model, budget="20GB", example_inputs=(x,), cache=True)        # ~/.cache/autoremat
    optimize(model, budget="20GB", example_inputs=(x,), cache="/tmp/plans")

A plan is only valid for the graphs it was made for, so the key is a hash of everything that can
change the decision: the first graph's structural fingerprint (ops, wiring, shapes, dtypes), the
budget, the ledger (optimizer state, sharding, inputs), the device, precision settings, solver
options, and the autoremat and torch versions. Fingerprints exist only after tracing, so the
planner asks the cache once the first joint graph is in hand (see `planner.CapturePlanner`).

Nothing read from disk is trusted: an entry that does not parse, was written for another key,
or whose plan no longer simulates to what it claims is ignored and overwritten by a fresh plan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autoremat.planning.plan import Plan, _version
from autoremat.torch_internals import tree_leaves

log = logging.getLogger("autoremat")

MAX_ENTRIES = 512  # oldest entries beyond this are dropped on every store: the directory stays small


def default_dir() -> Path:
    return Path(os.environ.get("AUTOREMAT_CACHE_DIR") or Path.home() / ".cache" / "autoremat")


def precision_mode(device: str) -> dict:
    """The ambient numeric settings a traced graph depends on but its fingerprint may not show."""
    kind = torch.device(device).type
    autocast = torch.is_autocast_enabled(kind) if kind in ("cpu", "cuda") else False
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "autocast": str(torch.get_autocast_dtype(kind)) if autocast else "off",
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


class PlanCache:
    """Plans on disk, one JSON file per key, written atomically."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def open(cls, cache: bool | str | Path | None) -> PlanCache | None:
        """`cache` as `optimize` takes it: True (default location), False/None (off) or a directory."""
        if cache is None or cache is False:
            return None
        if cache is True:
            return cls(default_dir())
        if isinstance(cache, (str, os.PathLike)):
            return cls(Path(cache))
        raise TypeError(f"cache must be True, False or a directory path, got {type(cache).__name__}")

    @staticmethod
    def key(fingerprint: str, fields: dict[str, Any]) -> str:
        """Hash of the first graph's fingerprint and every option that shapes the plan."""
        blob = json.dumps({"fingerprint": fingerprint, "autoremat": _version(), "torch": torch.__version__,
                           **fields}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def load(self, key: str) -> Plan | None:
        """The plan stored under `key`, or None if there is none or it cannot be trusted."""
        def plan_of(entry: dict) -> Plan:
            plan = Plan.from_dict(entry["plan"])
            if plan.versions.get("torch") != torch.__version__ or plan.versions.get("autoremat") != _version():
                raise ValueError(f"entry was made with {plan.versions}")
            return plan
        return self._read(key, plan_of)

    def _read(self, key: str, parse: Callable[[dict], Any]) -> Any:
        """`parse(entry)` of the JSON stored under `key`, or None: no file, another key's entry, or anything
        `parse` raises on (any way a file can be broken is a miss, never an error)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") != key:  # renamed or copied from another key
                raise ValueError(f"entry is for key {entry.get('key')!r}")
            return parse(entry)
        except Exception as e:
            log.warning("autoremat: ignoring unusable plan cache entry %s (%s: %s)", path, type(e).__name__, e)
            return None

    def store(self, key: str, plan: Plan, fields: dict[str, Any]) -> Path | None:
        """Write `plan` under `key`. A cache that cannot be written is only worth a warning."""
        return self._write(key, {"fields": fields, "plan": plan.to_dict()})

    def _write(self, key: str, entry: dict[str, Any]) -> Path | None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"key": key, **entry}, sort_keys=True, default=str)
            # Write then rename: a reader never sees half a file, even with two processes planning.
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path(key))
            self._prune()
        except OSError as e:
            log.warning("autoremat: could not write the plan cache at %s: %s", self.root, e)
            return None
        return self.path(key)

    @staticmethod
    def step_key(model: torch.nn.Module, args: tuple, kwargs: dict, fields: dict[str, Any]) -> str:
        """A key for a step before it is traced: the model's class, its parameters' and buffers' names, shapes,
        dtypes and whether they train, the batch's shapes and dtypes, and `fields`. Two steps can share it
        (the same shapes, other code), so it names no plan, only what to trace first (`store_count`, `store_form`)."""
        def describe(x: Any) -> Any:
            return [list(x.shape), str(x.dtype), x.device.type] if isinstance(x, torch.Tensor) else repr(x)
        blob = json.dumps({"model": type(model).__qualname__, "autoremat": _version(), "torch": torch.__version__,
                           "parameters": [[n, describe(p), p.requires_grad] for n, p in model.named_parameters()],
                           "buffers": [[n, describe(b)] for n, b in model.named_buffers()],
                           "batch": [describe(x) for x in tree_leaves((args, kwargs))], **fields},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    @staticmethod
    def note_key(key: str, what: str) -> str:
        """Where what a plan of the step whose `step_key` is `key` chose (`what`) is kept."""
        return hashlib.sha256(f"{key}/{what}".encode()).hexdigest()[:32]

    def store_count(self, key: str, chunks: int) -> None:
        """Remember that the step whose `step_key` is `key` was planned with its loss region in `chunks`
        pieces. That plan is stored under the chunked trace's own key, which is known only once the chunked
        step is traced: this lets a later run trace that count alone, not the whole step first and then
        every candidate."""
        self._write(self.note_key(key, "loss_chunks"), {"chunks": chunks, **_made_with()})

    def load_count(self, key: str) -> int | None:
        """The chunk count `store_count` kept for `key`, or None (none, unreadable, or from other versions)."""
        def count_of(entry: dict) -> int:
            chunks = _check_made_with(entry)["chunks"]
            if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
                raise ValueError(f"chunk count {chunks!r}")
            return chunks
        return self._read(self.note_key(key, "loss_chunks"), count_of)

    def store_form(self, key: str, regions: bool) -> None:
        """Remember that regions="auto" planned the step whose `step_key` is `key` as one graph (regions=False),
        or forget it (True: one graph per repeated block, which a step is captured as first anyway). A one-graph
        plan is stored under the one graph's key: this lets a later run trace that form first, not the cut step
        and then the one graph."""
        if regions:
            self.discard(self.note_key(key, "regions"))
        else:
            self._write(self.note_key(key, "regions"), {"regions": regions, **_made_with()})

    def load_form(self, key: str) -> bool | None:
        """The form `store_form` kept for `key`, or None (none, unreadable, or from other versions)."""
        def form_of(entry: dict) -> bool:
            regions = _check_made_with(entry)["regions"]
            if not isinstance(regions, bool):
                raise ValueError(f"regions {regions!r}")
            return regions
        return self._read(self.note_key(key, "regions"), form_of)

    def discard(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def _prune(self) -> None:
        entries = sorted(self.root.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-MAX_ENTRIES]:
            old.unlink(missing_ok=True)


def _made_with() -> dict[str, str]:
    return {"autoremat": _version(), "torch": torch.__version__}


def _check_made_with(entry: dict) -> dict:
    """`entry`, if this autoremat and torch wrote it (what a step chose may differ under others)."""
    if entry.get("autoremat") != _version() or entry.get("torch") != torch.__version__:
        raise ValueError(f"entry was made with autoremat {entry.get('autoremat')}, torch {entry.get('torch')}")
    return entry

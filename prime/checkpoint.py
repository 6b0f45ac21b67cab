"""Checkpoints: model and inner optimizer through torch.distributed.checkpoint, DiLoCo and data state per process.

Layout (one tree per node, as nodes usually do not share a file system):

    <dir>/node<r>/step_<000120>/
        .metadata, __*_*.distcp    model + inner AdamW (DCP: works with FSDP2 DTensors)
        rank<g>.pt                 this process's outer weights, outer momentum,
                                   error-feedback residual (this node's own),
                                   DiLoCo counters, data position, step
        manifest.json              written last: size and SHA-256 of every other file

A step is complete on a node when its manifest exists. The manifest is written
(atomically: a temporary file, fsync, rename) by local rank 0 only after every
process of the node has finished writing its files; the processes hash the
files between them, each its share.

Resume verifies before it loads: every file the manifest names must exist with
its size and hash, and no other file may be there. A damaged checkpoint is
named with its file and skipped. Nodes agree on the newest step that every one
of them holds intact (a few rounds through the cross-node store: each node
verifies only the step proposed in that round), so a node that died mid-write
or whose disk damaged a file does not resume from a different step than the
others. When some node holds checkpoints but no step is intact on every node
(one damaged, one never completed or its directory emptied), every process
stops with CheckpointError rather than silently starting over.

Once a checkpoint of step n is complete, the node's steps newer than n are
removed (with a line naming them): they are of another run (one started with
checkpoint.resume = false over it) and a restart would resume from them.

Saving is asynchronous when asked: dcp.async_save stages (copies) the state to
CPU memory before returning, and a background thread writes it, the extra
state and the manifest; only the copy stalls training. At most one save is in
flight; the next save waits for the previous one.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import hmac
import itertools
import json
import os
import re
import shutil
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from prime.comm import store_keys as keys

__all__ = ["Checkpointer", "CheckpointError", "TrainCheckpoints", "agree_on_resume_step", "verify_step_dir", "MANIFEST",
           "manifest_key"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
_MANIFEST_FORMAT = 1
_HASH_CHUNK = 4 << 20  # 4 MiB reads: hashlib releases the GIL on large buffers


class CheckpointError(RuntimeError):
    """No intact checkpoint to resume from, or one that cannot be loaded (the message names the file and what to do)."""


def _clone_tree(obj):
    """A copy of nested dicts/lists whose tensors are cloned to CPU (so training can go on while it is written)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def hash_file(path: str) -> dict:
    """{"size": bytes, "sha256": hex digest} of the file at `path`."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoint_files(path: str) -> list[str]:
    """The files of a step directory that the manifest covers (everything but the manifest and temporaries), sorted."""
    return sorted(n for n in os.listdir(path) if n != MANIFEST and not n.endswith(".tmp")
                  and os.path.isfile(os.path.join(path, n)))


def manifest_key(secret: Optional[bytes] = None) -> Optional[bytes]:
    """The key that signs checkpoint manifests: derived from the job secret (`secret`, else $PRIME_RING_SECRET);
    None when there is none (manifests then detect damage, not forgery). A secret drawn for one launch does not
    sign: the next launch could not check what it signed."""
    if secret is None:
        env = os.environ.get("PRIME_RING_SECRET")
        secret = env.encode() if env else None
    if not secret:
        return None
    return hmac.new(secret, b"prime checkpoint manifest v1", hashlib.sha256).digest()


def _mac(key: bytes, doc: dict) -> str:
    body = {k: v for k, v in doc.items() if k != "mac"}
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def write_manifest(path: str, step: int, files: dict, key: Optional[bytes] = None) -> None:
    """Writes `path`/manifest.json naming `files` ({name: {"size", "sha256"}}) atomically and durably; with `key`,
    signed (an HMAC-SHA256 of the step, its directory and every file's size and hash)."""
    doc = {"format": _MANIFEST_FORMAT, "step": step, "files": dict(sorted(files.items()))}
    if key is not None:
        doc["dir"] = os.path.basename(os.path.dirname(os.path.abspath(path)))  # node<r>: not another node's
        doc["mac"] = _mac(key, doc)
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))
    _fsync_dir(path)


def read_manifest(path: str, step: Optional[int] = None, key: Optional[bytes] = None) -> tuple[Optional[dict], Optional[str]]:
    """(files of the manifest of step directory `path`, None) or (None, what is wrong with the manifest). With
    `key`, the manifest must carry a valid signature under it (a file rewritten together with its manifest entry
    is refused)."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None, f"{mpath} is missing"
    except (OSError, ValueError) as e:
        return None, f"{mpath} is unreadable ({type(e).__name__}: {e})"
    files = doc.get("files") if isinstance(doc, dict) else None
    if (not isinstance(files, dict) or doc.get("format") != _MANIFEST_FORMAT
            or not all(isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                       for v in files.values())):
        return None, f"{mpath} is not a manifest of format {_MANIFEST_FORMAT}"
    strays = [n for n in files if not n or "/" in n or os.sep in n or n in (".", "..")]
    if strays:
        return None, f"{mpath} names files outside its directory: {strays[:3]}"
    if step is not None and doc.get("step") != step:
        return None, f"{mpath} is the manifest of step {doc.get('step')!r}, not of step {step}"
    if key is not None:
        mac = doc.get("mac")
        if not isinstance(mac, str):
            return None, (f"{mpath} is not signed, but this job has a secret (PRIME_RING_SECRET): written without "
                          "it, or its signature was stripped")
        if not hmac.compare_digest(mac, _mac(key, doc)):
            return None, (f"{mpath} has a signature that does not match under this job's secret: the checkpoint "
                          "was changed (forged) or written by another job")
        here = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if doc.get("dir") != here:
            return None, f"{mpath} was signed for {doc.get('dir')!r}, not for {here!r} (moved from another node)"
    return files, None


def verify_files(path: str, manifest: dict, names: list[str]) -> list[str]:
    """Problems of the files `names` of step directory `path` against `manifest` ([] when all match)."""
    problems = []
    for name in names:
        fpath = os.path.join(path, name)
        want = manifest.get(name)
        if want is None:
            problems.append(f"{fpath} is not in the manifest")
            continue
        try:
            size = os.path.getsize(fpath)
        except OSError:
            problems.append(f"{fpath} is missing")
            continue
        if size != want["size"]:  # a cheap test first: truncated files need no hashing
            problems.append(f"{fpath} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)")
            continue
        try:
            got = hash_file(fpath)["sha256"]
        except OSError as e:
            problems.append(f"{fpath} cannot be read ({e})")
            continue
        if got != want["sha256"]:
            problems.append(f"{fpath} does not match the manifest: sha256 {got[:16]}..., "
                            f"the manifest says {want['sha256'][:16]}... (the file was changed)")
    return problems


def verify_step_dir(path: str, step: Optional[int] = None, share: tuple[int, int] = (0, 1),
                    key: Optional[bytes] = None) -> list[str]:
    """Problems of the checkpoint in step directory `path` ([]: intact; with `key`, also signed by this job).

    `share` = (g, n) checks only every n-th file from the g-th on, so that n
    processes can verify one checkpoint between them (the manifest itself and
    the list of files are checked by every process)."""
    manifest, problem = read_manifest(path, step, key)
    if problem:
        return [problem]
    names = sorted(set(manifest) | set(_checkpoint_files(path)))
    if not names:
        return [f"{path}: the manifest names no files"]
    g, n = share
    return verify_files(path, manifest, names[g::n])


class Checkpointer:
    """Saves, verifies and loads the checkpoints of one process (node `node_rank`, local rank `local_rank` of `local_world`).

    With a `process_group` (the node's processes) save, verify and load are
    collective: every process of the node calls them in the same order."""

    def __init__(
        self,
        root: str,
        node_rank: int,
        local_rank: int,
        local_world: int,
        *,
        process_group=None,
        keep: int = 2,
        async_save: bool = True,
        key: Optional[bytes] = None,
        log: Optional[Callable[[str], None]] = None,
    ):
        self.root = root
        self.key = key
        """Signs and checks the manifests (manifest_key(); None: unsigned)."""
        self.log = log
        """Where local rank 0 says which checkpoints it removed as left by another run (None: print)."""
        self.node_dir = os.path.join(root, f"node{node_rank}")
        self.local_rank, self.local_world = local_rank, local_world
        self.pg, self.keep, self.async_save = process_group, keep, async_save
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prime-ckpt")
        self._pending: Optional[concurrent.futures.Future] = None
        os.makedirs(self.node_dir, exist_ok=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.node_dir, f"step_{step:08d}")

    # -- which checkpoints exist -------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps of this node whose manifest was written (not yet verified), oldest first."""
        steps = []
        for path in glob.glob(os.path.join(self.node_dir, "step_*")):
            m = _STEP_DIR.match(os.path.basename(path))
            if m and os.path.exists(os.path.join(path, MANIFEST)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _gather(self, obj) -> list:
        """`obj` of every process of the node, in local-rank order."""
        if self.pg is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def verify(self, step: int) -> list[str]:
        """Problems of the checkpoint of `step` on this node ([]: intact); the node's processes hash a share each."""
        problems = verify_step_dir(self.step_dir(step), step, (self.local_rank, self.local_world), self.key)
        return sorted(set(itertools.chain.from_iterable(self._gather(problems))))

    # -- saving ------------------------------------------------------------------

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, *, block: bool = False) -> None:
        """Writes the checkpoint of `step`: model and optimizer through DCP, `extra` (a dict of CPU state) with torch.save,
        then the manifest.

        With async saving (and block=False) this returns once the state is copied;
        call wait() to know it is on disk.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()  # one save in flight at a time; also surfaces errors of the previous one
        # Steps newer than this one that are here already were left by another run (the node's other processes
        # are at most at this save: its manifest waits for all of them). Listed now, not when pruning: by then
        # another process may have made the directory of its next save.
        left = [s for s in self._step_dirs() if s > step] if self.local_rank == 0 else []
        path = self.step_dir(step)
        os.makedirs(path, exist_ok=True)
        stale = os.path.join(path, MANIFEST)
        if self.local_rank == 0 and os.path.exists(stale):
            os.remove(stale)  # rewriting a step: it is not complete until the new manifest is written
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.async_save and not block:  # written later: a copy of what may change meanwhile
            extra = _clone_tree(extra)
        dist_kwargs = {"process_group": self.pg} if self.pg is not None else {"no_dist": True}

        with warnings.catch_warnings():
            # Without a process group DCP warns that it assumes a single process: that is what we asked for.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if self.async_save and not block:
                dcp_future = dcp.async_save(state, checkpoint_id=path, **dist_kwargs)
                if hasattr(dcp_future, "upload_completion"):  # newer torch returns an AsyncSaveResponse
                    dcp_future = dcp_future.upload_completion
            else:
                dcp.save(state, checkpoint_id=path, **dist_kwargs)
                dcp_future = None

        def finish():
            if dcp_future is not None:
                dcp_future.result()
            tmp = os.path.join(path, f"rank{self.local_rank}.pt.tmp")
            with open(tmp, "wb") as f:
                torch.save(extra, f)
                f.flush()
                os.fsync(f.fileno())  # on disk before the manifest says it is
            os.replace(tmp, os.path.join(path, f"rank{self.local_rank}.pt"))  # atomic: never a half-written file
            # Every process's files are written once all have got here (DCP's own
            # files before its save returned): hash them between us, then rank 0
            # writes the manifest, the last file of the checkpoint.
            self._gather(None)
            names = _checkpoint_files(path)
            mine = {n: hash_file(os.path.join(path, n)) for n in names[self.local_rank :: self.local_world]}
            hashes = {}
            for part in self._gather(mine):
                hashes.update(part)
            if self.local_rank == 0:
                write_manifest(path, step, hashes, self.key)
                self._prune(step, left)

        self._pending = self._pool.submit(finish)
        if block or not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is on disk; raises its error if it failed."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()

    def _step_dirs(self) -> list[int]:
        """Steps of this node that have a directory (complete or not), oldest first."""
        return sorted(int(m.group(1)) for m in (_STEP_DIR.match(n) for n in os.listdir(self.node_dir)) if m
                      and os.path.isdir(os.path.join(self.node_dir, m.group(0))))

    def _remove_step(self, step: int) -> Optional[str]:
        """Removes the directory of `step`, its manifest first (interrupted, it leaves no step that looks complete);
        None, or why it could not."""
        path = self.step_dir(step)
        try:
            os.remove(os.path.join(path, MANIFEST))
        except FileNotFoundError:
            pass
        except OSError as e:
            return f"{path}: {e}"
        shutil.rmtree(path, ignore_errors=True)
        return None

    def _prune(self, newest: int, newer: list) -> None:
        """Once the checkpoint of `newest` is complete (its manifest written, never before): removes `newer`, this
        node's steps newer than it found when its save began, complete or not (left by a run that this one started
        over: a restart would resume from them, not from this run), then all but the `keep` newest complete steps
        up to it."""
        if newer:
            failed = [p for p in map(self._remove_step, newer) if p]
            msg = (f"removed the checkpoints of steps {newer} from {self.node_dir}: newer than step {newest}, which "
                   "this run has just saved, they were left by an earlier run that this one started over (e.g. "
                   "with checkpoint.resume = false), and a restart would have resumed from them")
            if failed:
                msg += f"; could not remove {failed}: remove them by hand before restarting"
            (self.log or _print)(msg)
        if self.keep <= 0:
            return
        complete = [s for s in self.complete_steps() if s <= newest]
        for s in complete[: -self.keep]:
            self._remove_step(s)

    # -- resuming ------------------------------------------------------------------

    def choose_resume_step(self, store, node_rank: int, num_nodes: int, publish: bool,
                           log: Optional[Callable[[str], None]] = None, scope: str = "") -> Optional[int]:
        """The newest step that every node holds intact (verified against its manifest), or None: start fresh.

        Collective over the node's processes and, through `store`, over the
        nodes. Damaged checkpoints are reported through `log` with the file
        and skipped. Raises CheckpointError when checkpoints exist but none is
        intact on every node (on every process of every node alike)."""
        def verify(step: int) -> list[str]:
            problems = self.verify(step)
            if problems and log is not None:
                log(f"checkpoint of step {step} on node {node_rank} is damaged, not resuming from it:\n  "
                    + "\n  ".join(problems))
            return problems

        step, damaged, bad_nodes, held = agree_on_resume_step(
            self.complete_steps(), verify, store, node_rank, num_nodes, publish, scope)
        if step is None and bad_nodes:
            here = "; ".join(f"step {s}: {p[0]}" for s, p in sorted(damaged.items()))
            raise CheckpointError(
                f"no checkpoint under {self.root} is intact on every node: node(s) {bad_nodes} hold only damaged ones"
                + (f" (here: {here})" if here else "")
                + ". Restore them from a copy, or remove them (or set checkpoint.resume = false) to start fresh."
            )
        if step is None and any(held):  # every node decides alike: on the offers that all of them read
            holders = "; ".join(f"node {r}: steps {s}" for r, s in enumerate(held) if s)
            lacking = [r for r, s in enumerate(held) if not s]
            raise CheckpointError(
                f"no checkpoint under {self.root} is complete on every node: {holders}"
                + (f"; node(s) {lacking}: none" if lacking else "; no step is common to all")
                + " (a writer that died before its manifest, or a node's directory emptied or replaced). Restore "
                "the missing node's directory from a copy to resume, or set checkpoint.resume = false to start "
                "fresh (the checkpoints left here are then removed once the new run's first one is complete)."
            )
        return step

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Restores model and optimizer in place from the checkpoint of `step`; returns this process's extra state.

        Call it with a step that verify() passed; any failure is a CheckpointError naming the checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = self.step_dir(step)
        extra_path = os.path.join(path, f"rank{self.local_rank}.pt")
        if not os.path.exists(extra_path):
            raise CheckpointError(
                f"{extra_path} is missing: the checkpoint of step {step} was written by a node with fewer "
                "processes; resume with the same number of processes per node"
            )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dist_kwargs = {"process_group": self.pg} if self.pg is not None else {"no_dist": True}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=path, **dist_kwargs)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            return torch.load(extra_path, map_location="cpu", weights_only=True)
        except Exception as e:  # intact files that do not fit this model (another shape, another torch)
            raise CheckpointError(
                f"the checkpoint of step {step} in {path} passed its manifest but cannot be loaded into this model "
                f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); resume with the "
                "settings that wrote it, or set checkpoint.resume = false to start fresh"
            ) from e

    def close(self) -> None:
        """Waits for the save in flight and stops the writer thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


class TrainCheckpoints:
    """The checkpoints of a training run: what a step's state is, resuming from it, and saving only finite states.

    A step's state is the model and the inner optimizer (through DCP), and per
    process the data position, DiLoCo's state (outer weights, momentum,
    counters), the CPU RNG and the step. `data` and `diloco` are anything with
    state_dict() / load_state_dict(); `local_sum` sums small values over the
    node's processes (a collective: save() is one)."""

    def __init__(self, checkpointer: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer, data, diloco,
                 local_sum: Callable[[list], list]):
        self.checkpointer = checkpointer
        self.model, self.optimizer, self.data, self.diloco, self.local_sum = model, optimizer, data, diloco, local_sum

    def resume(self, store, node_rank: int, num_nodes: int, publish: bool,
               log: Optional[Callable[[str], None]] = None, scope: str = "") -> Optional[int]:
        """Loads the newest step that every node holds intact (Checkpointer.choose_resume_step) into the model,
        the optimizer, the data and DiLoCo; returns that step, or None (nothing to resume: start fresh).
        Raises CheckpointError on every process of every node alike when checkpoints exist but none is intact."""
        if log is not None and self.checkpointer.log is None:
            self.checkpointer.log = log  # also where the saves say what they removed
        step = self.checkpointer.choose_resume_step(store, node_rank, num_nodes, publish=publish, log=log, scope=scope)
        if step is None:
            return None
        extra = self.checkpointer.load(step, self.model, self.optimizer)
        self.data.load_state_dict(extra["data"])
        self.diloco.load_state_dict(extra["diloco"])
        torch.set_rng_state(extra["rng"])
        return int(extra["step"])

    @torch.no_grad()
    def state_is_finite(self) -> bool:
        """Whether this node's weights and optimizer moments are all finite (every process of the node calls it)."""
        from prime.parallelize import local_shard

        tensors = [local_shard(p.detach()) for p in self.model.parameters()]
        tensors += [local_shard(t) for st in self.optimizer.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1]
        ok = bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True
        return self.local_sum([0.0 if ok else 1.0])[0] == 0

    def save(self, step: int, *, block: bool = False) -> bool:
        """Checkpoints the state of `step` (asynchronously unless `block`). Returns False, saving nothing, when
        the weights or the optimizer state are not finite on some process of the node."""
        if not self.state_is_finite():
            return False
        extra = {"step": step, "data": self.data.state_dict(), "diloco": self.diloco.state_dict(),
                 "rng": torch.get_rng_state()}
        self.checkpointer.save(step, self.model, self.optimizer, extra, block=block)
        return True

    def newest(self) -> Optional[int]:
        """The newest complete step on this node once the save in flight is done (None: none was written)."""
        self.checkpointer.wait()  # a save in flight is of a state from before now
        done = self.checkpointer.complete_steps()
        return done[-1] if done else None

    def wait(self) -> None:
        """Blocks until the save in flight is on disk."""
        self.checkpointer.wait()

    def close(self) -> None:
        """Waits for the save in flight and stops the writer thread."""
        self.checkpointer.close()


def _print(msg: str) -> None:
    print(msg, flush=True)


def agree_on_resume_step(
    local_steps: list[int], verify: Callable[[int], list[str]], store, node_rank: int, num_nodes: int, publish: bool,
    scope: str = "",
) -> tuple[Optional[int], dict, list[int], list[list[int]]]:
    """The newest step that every node holds intact: (step or None, {step: problems} found here, nodes that found
    damage, the complete steps that each node held, intact or not, by node rank).

    Every node gets the same answer but the second: the rest is read from the offers that all of them read (a node
    holding checkpoints while none is common to all is seen alike everywhere).

    Rounds through `store` (the cross-node store; None: one node): each node
    offers its complete steps minus those it found damaged; the newest step
    offered by all is verified by each node (`verify(step)` -> problems, []
    when intact; each step at most once per node). A step that some node
    found damaged is offered by none in the next round; a step that every
    node found intact stays the newest common one and is the answer. One
    process per node (`publish`) writes the node's offer; every process reads
    all offers, and all processes of a node must get the same verify() results.
    """
    offer = sorted(set(local_steps))
    damaged: dict[int, list[str]] = {}
    intact: set[int] = set()
    for rnd in itertools.count():
        mine = {"steps": offer, "damaged": sorted(damaged)}
        if store is None or num_nodes == 1:
            offers = [mine]
        else:
            if publish:
                store.set(keys.resume_offer(rnd, node_rank, scope), json.dumps(mine))
            offers = [json.loads(store.get(keys.resume_offer(rnd, r, scope)).decode()) for r in range(num_nodes)]
        common = set(offers[0]["steps"]).intersection(*(o["steps"] for o in offers[1:]))
        bad_nodes = [r for r, o in enumerate(offers) if o["damaged"]]
        held = [sorted(set(o["steps"]) | set(o["damaged"])) for o in offers]  # an offer drops only damaged steps
        if not common:
            return None, damaged, bad_nodes, held
        step = max(common)
        if step in intact:  # every node offered it again after verifying it: all hold it intact
            return step, damaged, bad_nodes, held
        problems = verify(step)
        if problems:
            damaged[step] = problems
            offer = [s for s in offer if s != step]
        else:
            intact.add(step)

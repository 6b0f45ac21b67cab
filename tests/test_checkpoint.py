"""Checkpoint integrity: the manifest, what verification finds, and how nodes agree on a step to resume.

One process, no process group (DCP with no_dist): each test takes well under a
second. The end-to-end fallback under torchrun is in tests/test_train.py.
"""

import hashlib
import json
import os
import random
import threading
from datetime import timedelta

import pytest
import torch
from torch import nn

from prime.checkpoint import MANIFEST, CheckpointError, Checkpointer, agree_on_resume_step, verify_step_dir


@pytest.fixture
def seed():
    s = random.randrange(1 << 30)
    print(f"seed {s}")
    return s


def _model_and_optim(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 64), nn.Linear(64, 32))  # 5.2k values: files of several 4 KiB pages
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 48)).square().mean().backward()
    opt.step()  # AdamW moments exist and get saved
    return model, opt


def _save(tmp_path, seed, steps, keep=0):
    model, opt = _model_and_optim(seed)
    ck = Checkpointer(str(tmp_path), 0, 0, 1, keep=keep, async_save=True)
    saved = {}
    for s in steps:
        with torch.no_grad():
            model[0].weight.add_(1.0)
        saved[s] = model[0].weight.detach().clone()
        ck.save(s, model, opt, {"step": s, "marker": torch.full((3,), float(s))})
        ck.wait()  # the next add_ must not race the background copy
    model.saved = saved
    return ck, model, opt


def _largest_distcp(path):
    files = [n for n in os.listdir(path) if n.endswith(".distcp")]
    return os.path.join(path, max(files, key=lambda n: os.path.getsize(os.path.join(path, n))))


def _overwrite_4k(path, rng):
    """Overwrites 4 KiB at a random offset with different bytes; the size stays."""
    size = os.path.getsize(path)
    assert size > 4096, size
    off = rng.randrange(size - 4096)
    with open(path, "r+b") as f:
        f.seek(off)
        old = f.read(4096)
        new = bytes((b + rng.randrange(1, 256)) % 256 for b in old)  # every byte changes
        f.seek(off)
        f.write(new)
    assert os.path.getsize(path) == size


def test_manifest_names_every_file_with_its_sha256(tmp_path, seed):
    ck, _, _ = _save(tmp_path, seed, [3])
    path = ck.step_dir(3)
    with open(os.path.join(path, MANIFEST)) as f:
        doc = json.load(f)
    assert doc["step"] == 3
    on_disk = sorted(n for n in os.listdir(path) if n != MANIFEST)
    assert sorted(doc["files"]) == on_disk and "rank0.pt" in on_disk and ".metadata" in on_disk
    assert any(n.endswith(".distcp") for n in on_disk)
    for name, entry in doc["files"].items():  # an independent hash of each file
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert ck.complete_steps() == [3] and ck.verify(3) == []
    ck.close()


def test_a_step_without_manifest_is_not_complete(tmp_path, seed):
    ck, _, _ = _save(tmp_path, seed, [2, 4])
    os.remove(os.path.join(ck.step_dir(4), MANIFEST))  # as if the writer died before the manifest
    assert ck.complete_steps() == [2]
    ck.close()


@pytest.mark.parametrize("damage", ["overwrite_4k", "truncate", "empty", "delete", "extra_file", "bad_manifest",
                                    "manifest_of_other_step", "manifest_names_outside"])
def test_verify_names_the_damaged_file(tmp_path, seed, damage):
    rng = random.Random(seed)
    ck, _, _ = _save(tmp_path, seed, [5])
    path = ck.step_dir(5)
    target = _largest_distcp(path)
    if damage == "overwrite_4k":
        _overwrite_4k(target, rng)
        want = f"{target} does not match the manifest"
    elif damage == "truncate":
        size = os.path.getsize(target)
        os.truncate(target, rng.randrange(size))
        want = f"{target} has {os.path.getsize(target)} bytes, the manifest says {size}"
    elif damage == "empty":
        size = os.path.getsize(target)
        open(target, "wb").close()
        want = f"{target} has 0 bytes, the manifest says {size}"
    elif damage == "delete":
        os.remove(target)
        want = f"{target} is missing"
    elif damage == "extra_file":
        target = os.path.join(path, "__9_0.distcp")
        with open(target, "wb") as f:
            f.write(b"x")
        want = f"{target} is not in the manifest"
    elif damage == "bad_manifest":
        with open(os.path.join(path, MANIFEST), "r+b") as f:
            f.truncate(10)
        want = f"{os.path.join(path, MANIFEST)} is unreadable"
    elif damage == "manifest_names_outside":
        mpath = os.path.join(path, MANIFEST)
        with open(mpath) as f:
            doc = json.load(f)
        doc["files"]["../../secret"] = {"size": 1, "sha256": "0" * 64}
        with open(mpath, "w") as f:
            json.dump(doc, f)
        want = f"{mpath} names files outside its directory: ['../../secret']"
    else:
        other = os.path.join(str(tmp_path), "node0", "step_00000006")
        os.rename(path, other)  # a step directory renamed to pass for another step
        path = other
        want = f"{os.path.join(other, MANIFEST)} is the manifest of step 5, not of step 6"
    step = 6 if damage == "manifest_of_other_step" else 5
    problems = ck.verify(step)
    assert len(problems) == 1 and problems[0].startswith(want), problems
    ck.close()


def test_shares_of_the_verification_cover_every_file(tmp_path, seed):
    """n processes verify a step between them: each damaged file is found by exactly one share."""
    rng = random.Random(seed)
    ck, _, _ = _save(tmp_path, seed, [1])
    path = ck.step_dir(1)
    names = sorted(n for n in os.listdir(path) if n != MANIFEST)
    for name in names:
        with open(os.path.join(path, name), "ab") as f:
            f.write(b"!")  # every file damaged
    for n in (1, 2, 3):
        found = [p for g in range(n) for p in verify_step_dir(path, 1, (g, n))]
        assert sorted(p.split(" has ")[0] for p in found) == [os.path.join(path, m) for m in names], (n, found)
    ck.close()


def test_resume_falls_back_to_the_newest_intact_step_and_loads_it(tmp_path, seed):
    rng = random.Random(seed)
    ck, model, opt = _save(tmp_path, seed, [2, 4, 6])
    _overwrite_4k(_largest_distcp(ck.step_dir(6)), rng)
    os.truncate(_largest_distcp(ck.step_dir(4)), 100)
    logged = []
    step = ck.choose_resume_step(None, 0, 1, True, log=logged.append)
    assert step == 2
    assert len(logged) == 2 and "step 6" in logged[0] and "does not match" in logged[0], logged
    assert "step 4" in logged[1] and "has 100 bytes" in logged[1], logged
    fresh, fresh_opt = _model_and_optim(seed + 1)
    extra = ck.load(2, fresh, fresh_opt)
    assert extra["step"] == 2 and torch.equal(extra["marker"], torch.full((3,), 2.0))
    assert torch.equal(fresh[0].weight, model.saved[2]) and not torch.equal(model.saved[2], model.saved[6])
    assert torch.equal(fresh[1].weight, model[1].weight)
    ck.close()


def test_resume_stops_with_a_clear_error_when_nothing_is_intact(tmp_path, seed):
    rng = random.Random(seed)
    ck, _, _ = _save(tmp_path, seed, [2, 4])
    for s in (2, 4):
        _overwrite_4k(_largest_distcp(ck.step_dir(s)), rng)
    with pytest.raises(CheckpointError) as info:
        ck.choose_resume_step(None, 0, 1, True)
    msg = str(info.value)
    assert "no checkpoint under" in msg and "node(s) [0]" in msg and "does not match the manifest" in msg
    assert "checkpoint.resume = false" in msg
    ck.close()


def test_no_checkpoint_at_all_starts_fresh(tmp_path):
    ck = Checkpointer(str(tmp_path), 0, 0, 1)
    assert ck.choose_resume_step(None, 0, 1, True) is None
    ck.close()


def test_prune_keeps_the_newest_complete_steps(tmp_path, seed):
    ck, _, _ = _save(tmp_path, seed, [1, 2, 3, 4], keep=2)
    assert ck.complete_steps() == [3, 4]
    assert sorted(os.listdir(ck.node_dir)) == ["step_00000003", "step_00000004"]
    ck.close()


# -- agreement across nodes (threads play the nodes, on one in-memory store) ----------


def _agree(offers, damaged, store_factory=None):
    """Runs agree_on_resume_step for len(offers) nodes at once; returns each node's result and its verify calls."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    n = len(offers)
    results, calls = [None] * n, [[] for _ in range(n)]

    def node(r):
        def verify(step):
            calls[r].append(step)
            return [f"node{r} step {step} bad"] if step in damaged.get(r, ()) else []

        results[r] = agree_on_resume_step(offers[r], verify, store, r, n, publish=True)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(res is not None for res in results), results
    return results, calls


def test_nodes_agree_on_the_newest_step_intact_everywhere():
    # node 1's step 12 is damaged, node 2 never finished step 16: all take 8
    results, calls = _agree([[4, 8, 12, 16], [4, 8, 12], [4, 8, 12]], {1: {12}})
    assert [r[0] for r in results] == [8, 8, 8]
    assert calls == [[12, 8], [12, 8], [12, 8]]  # nobody verifies 16 (not common) nor 4 (not needed)
    assert results[1][1] == {12: ["node1 step 12 bad"]} and results[0][1] == {}
    assert all(r[2] == [1] for r in results)


def test_nodes_agree_when_all_is_intact_with_one_verification_each():
    results, calls = _agree([[3, 6], [3, 6]], {})
    assert [r[0] for r in results] == [6, 6] and calls == [[6], [6]]


def test_nodes_all_stop_when_one_node_has_nothing_intact():
    results, _ = _agree([[2, 4], [2, 4]], {0: {2, 4}})
    assert [r[0] for r in results] == [None, None]
    assert [r[2] for r in results] == [[0], [0]]  # node 1 learns that node 0 found damage


def test_nodes_without_a_common_step_start_fresh_without_verifying():
    results, calls = _agree([[2], [4]], {})
    assert [r[0] for r in results] == [None, None] and calls == [[], []] and results[0][2] == []


# -- signed manifests ----------------------------------------------------------------------


def _forge(path, rng):
    """Changes the largest shard and rewrites its manifest entry to match (size and SHA-256): what someone who
    can write the checkpoint directory but does not hold the job secret can do."""
    shard = _largest_distcp(path)
    _overwrite_4k(shard, rng)
    mpath = os.path.join(path, MANIFEST)
    with open(mpath) as f:
        doc = json.load(f)
    with open(shard, "rb") as f:
        doc["files"][os.path.basename(shard)] = {"size": os.path.getsize(shard),
                                                  "sha256": hashlib.sha256(f.read()).hexdigest()}
    with open(mpath, "w") as f:
        json.dump(doc, f)
    return doc


def test_a_forged_checkpoint_is_refused_under_the_job_secret(tmp_path, seed):
    """With a secret the manifest is signed: a shard rewritten together with its manifest entry, a manifest
    whose signature was stripped, and a manifest copied from another node's directory are all refused, with
    the reason; the unsigned manifest of the same forgery passes (integrity alone cannot catch it)."""
    from prime.checkpoint import manifest_key

    rng = random.Random(seed)
    key = manifest_key(("secret-%d" % seed).encode())
    model, opt = _model_and_optim(seed)
    ck = Checkpointer(str(tmp_path / "signed"), 0, 0, 1, keep=0, async_save=False, key=key)
    for s in (2, 4):
        ck.save(s, model, opt, {"step": s})
    assert ck.verify(2) == [] and ck.verify(4) == []
    doc = _forge(ck.step_dir(4), rng)
    problems = ck.verify(4)
    assert len(problems) == 1 and "has a signature that does not match" in problems[0], problems
    assert ck.choose_resume_step(None, 0, 1, publish=True) == 2  # the forged step is skipped, the other kept
    doc.pop("mac")
    with open(os.path.join(ck.step_dir(4), MANIFEST), "w") as f:
        json.dump(doc, f)
    assert "is not signed" in ck.verify(4)[0]
    other = Checkpointer(str(tmp_path / "signed"), 1, 0, 1, keep=0, async_save=False, key=key)
    os.makedirs(other.step_dir(2))
    for name in os.listdir(ck.step_dir(2)):  # node 0's intact step 2, copied whole into node 1's directory
        with open(os.path.join(ck.step_dir(2), name), "rb") as src, open(os.path.join(other.step_dir(2), name), "wb") as dst:
            dst.write(src.read())
    assert "signed for 'node0', not for 'node1'" in other.verify(2)[0]
    assert Checkpointer(str(tmp_path / "signed"), 0, 0, 1, key=manifest_key(b"another")).verify(2)[0].endswith(
        "written by another job")
    plain = Checkpointer(str(tmp_path / "plain"), 0, 0, 1, keep=0, async_save=False)
    plain.save(4, model, opt, {"step": 4})
    _forge(plain.step_dir(4), rng)
    assert plain.verify(4) == []


def test_resume_offers_of_another_launch_are_not_read():
    """The resume agreement's keys carry the launch: signed offers recorded by an earlier launch (replayed into
    the store) are under another name, so the agreement waits for this launch's own and times out instead of
    resuming from the old offer."""
    import torch.distributed as dist

    from prime.comm import store_keys as keys
    from test_store_security import _trainer_kv

    store = dist.HashStore()
    old = _trainer_kv(store)
    for rnd in range(3):
        old.set(keys.resume_offer(rnd, 1, "launch-a"), json.dumps({"steps": [4], "damaged": []}))
    kv = _trainer_kv(store, timeout_s=0.5)
    assert agree_on_resume_step([4, 8], lambda s: [], _trainer_kv(store, timeout_s=0.5), 1, 1, True, "launch-b")[0] == 8
    with pytest.raises(TimeoutError, match=r"ckpt/launch-b/r0/node1"):
        agree_on_resume_step([4, 8, 12], lambda s: [], kv, 0, 2, publish=True, scope="launch-b")


# -- checkpoints on some node but no step common to all; a run started over older checkpoints ----------------


def _choose_on_nodes(root, n):
    """choose_resume_step on nodes 0..n-1 of `root` at once (threads, one in-memory store); each node's step or error."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    out = [None] * n

    def node(r):
        ck = Checkpointer(root, r, 0, 1)
        try:
            out[r] = ck.choose_resume_step(store, r, n, publish=True)
        except CheckpointError as e:
            out[r] = e
        finally:
            ck.close()

    threads = [threading.Thread(target=node, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _copy_node(root, src, dst):
    """Copies node `src`'s checkpoint tree to node `dst` (unsigned manifests name no directory)."""
    import shutil

    shutil.copytree(os.path.join(root, f"node{src}"), os.path.join(root, f"node{dst}"), dirs_exist_ok=True)


@pytest.mark.parametrize("case", ["died_before_manifest", "emptied", "disjoint"])
def test_every_node_stops_when_checkpoints_exist_but_no_step_is_common(tmp_path, seed, case):
    """Node 0 holds an intact step 8; node 1 holds none of it (its writer died before the manifest, its directory
    was emptied) or only another step: every node stops with the same CheckpointError instead of starting fresh
    (and overwriting node 0's checkpoints), and the message says how to go on. Before: every node started fresh."""
    root = str(tmp_path)
    ck, _, _ = _save(tmp_path, seed, [8])
    ck.close()
    if case == "died_before_manifest":
        _copy_node(root, 0, 1)
        os.remove(os.path.join(root, "node1", "step_00000008", MANIFEST))
    elif case == "emptied":
        os.makedirs(os.path.join(root, "node1"))
    else:
        _copy_node(root, 0, 1)
        os.rename(os.path.join(root, "node1", "step_00000008"), os.path.join(root, "node1", "step_00000004"))
        mpath = os.path.join(root, "node1", "step_00000004", MANIFEST)
        with open(mpath) as f:
            doc = json.load(f)
        doc["step"] = 4
        with open(mpath, "w") as f:
            json.dump(doc, f)
    out = _choose_on_nodes(root, 2)
    assert all(isinstance(e, CheckpointError) for e in out), out
    msgs = [str(e) for e in out]
    assert msgs[0] == msgs[1], msgs  # the same decision, from the same offers, on every node
    assert "is complete on every node: node 0: steps [8]" in msgs[0]
    if case == "disjoint":
        assert "node 1: steps [4]; no step is common to all" in msgs[0]
    else:
        assert "node(s) [1]: none" in msgs[0]
    assert "Restore the missing node's directory" in msgs[0] and "checkpoint.resume = false" in msgs[0]
    assert os.path.exists(os.path.join(root, "node0", "step_00000008", MANIFEST))  # nothing was touched


def test_agreement_reports_what_each_node_held():
    results, _ = _agree([[2, 4], [4], []], {1: {4}})
    assert all(r[0] is None and r[3] == [[2, 4], [4], []] for r in results), results
    results, _ = _agree([[], []], {})
    assert [r[0] for r in results] == [None, None] and all(r[3] == [[], []] for r in results)


def test_no_checkpoint_on_any_node_starts_fresh(tmp_path):
    os.makedirs(tmp_path / "node0" / "step_00000004")  # a step without manifest is no checkpoint
    assert _choose_on_nodes(str(tmp_path), 2) == [None, None]


def test_a_directory_made_by_another_process_for_its_next_save_is_not_removed(tmp_path, seed, monkeypatch):
    """Local rank 0 writes the manifest last, when the node's other processes may already have made the directory
    of their next save: only the steps newer than this save that were there when it began (another run's) go."""
    import prime.checkpoint as pc

    old, _, _ = _save(tmp_path, seed, [12], keep=2)
    old.close()
    model, opt = _model_and_optim(seed + 1)
    ck = Checkpointer(str(tmp_path), 0, 0, 1, keep=2, async_save=True)
    ck.log = lambda msg: None
    write = pc.write_manifest

    def write_while_another_process_moves_on(path, step, files, key=None):
        os.makedirs(ck.step_dir(8), exist_ok=True)  # another process of the node, at its next save
        write(path, step, files, key)

    monkeypatch.setattr(pc, "write_manifest", write_while_another_process_moves_on)
    ck.save(4, model, opt, {"step": 4})
    ck.wait()
    assert sorted(os.listdir(ck.node_dir)) == ["step_00000004", "step_00000008"]  # 12 (the other run's) removed
    ck.close()


def test_a_run_started_over_older_checkpoints_removes_their_newer_steps_once_its_first_is_complete(
        tmp_path, seed, monkeypatch):
    """An earlier run left steps 8 and 12 (and an incomplete 16); a run started over it (checkpoint.resume = false)
    saves step 4: once that checkpoint is complete, and not before, the newer steps are removed with one line
    naming them, so a restart resumes from this run's step 4, not from the other run's 12. Before: 8 and 12 were
    kept and resumed."""
    import prime.checkpoint as pc

    old, _, _ = _save(tmp_path, seed, [4, 8, 12], keep=2)
    old.close()
    os.makedirs(old.step_dir(16))
    assert old.complete_steps() == [8, 12]
    model, opt = _model_and_optim(seed + 1)
    logged = []
    ck = Checkpointer(str(tmp_path), 0, 0, 1, keep=2, async_save=True)
    ck.log = logged.append
    seen = []
    write = pc.write_manifest

    def failing_write(path, step, files, key=None):
        seen.append(sorted(os.listdir(ck.node_dir)))
        raise OSError("disk full")

    monkeypatch.setattr(pc, "write_manifest", failing_write)
    ck.save(4, model, opt, {"step": 4})
    with pytest.raises(OSError, match="disk full"):
        ck.wait()
    # the new checkpoint is not complete: nothing of the old run was removed
    assert seen == [["step_00000004", "step_00000008", "step_00000012", "step_00000016"]]
    assert ck.complete_steps() == [8, 12] and logged == []

    def checked_write(path, step, files, key=None):
        seen.append(sorted(os.listdir(ck.node_dir)))
        write(path, step, files, key)

    monkeypatch.setattr(pc, "write_manifest", checked_write)
    ck.save(4, model, opt, {"step": 4})
    ck.wait()
    assert seen[-1] == ["step_00000004", "step_00000008", "step_00000012", "step_00000016"]  # still there at the manifest
    assert sorted(os.listdir(ck.node_dir)) == ["step_00000004"]
    assert len(logged) == 1 and "removed the checkpoints of steps [8, 12, 16]" in logged[0], logged
    assert "newer than step 4" in logged[0] and ck.node_dir in logged[0]
    assert ck.choose_resume_step(None, 0, 1, True) == 4
    ck.save(8, model, opt, {"step": 8}, block=True)
    assert ck.complete_steps() == [4, 8] and len(logged) == 1  # nothing newer left: no more lines
    ck.close()


def test_train_checkpoints_resume_routes_the_removal_line_to_its_log(tmp_path, seed):
    """TrainCheckpoints.resume's log (the metrics printer) is where later saves say what they removed."""
    from prime.checkpoint import TrainCheckpoints

    old, _, _ = _save(tmp_path, seed, [12])
    old.close()
    ck = Checkpointer(str(tmp_path), 0, 0, 1, keep=0, async_save=False)
    tc = TrainCheckpoints(ck, *_model_and_optim(seed), data=None, diloco=None, local_sum=lambda v: [0.0 for _ in v])
    logged = []
    os.rename(ck.step_dir(12), ck.step_dir(12) + ".moved")  # nothing to resume: a fresh start
    assert tc.resume(None, 0, 1, publish=True, log=logged.append) is None
    os.rename(ck.step_dir(12) + ".moved", ck.step_dir(12))  # as if left by another run meanwhile
    ck.save(4, tc.model, tc.optimizer, {"step": 4})
    assert ck.complete_steps() == [4] and len(logged) == 1 and "steps [12]" in logged[0]
    ck.close()

"""benchmarks/gpu.sh and its suites, checked on the CPU: every suite parses, its dry run (DRY_RUN=1, every option
on) ends with the summary table, every script it calls exists, and every flag it passes is one the script or the
config knows. The GPU runs themselves are not made here."""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from prime.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "benchmarks", "gpu", "*.sh"))
                if not p.endswith("common.sh"))
ALL_OPTIONS = {"QERR": "1", "RING_1B": "1", "ALLREDUCE": "1", "RUNS": "0:dp 1", "BEFORE": "/nonexistent/before",
               "VARIANTS": "sync_1g sync_10g_compile overlap_1g overlap_10g_compile", "SCHEME": "eager", "PROCS": "2"}


def _dry_run(suite: str, tmp_path, **env):
    e = dict(os.environ, DRY_RUN="1", **dict(ALL_OPTIONS, **env))
    return subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), suite, str(tmp_path / suite)], env=e,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_old_per_work_scripts_are_gone_and_every_suite_is_listed():
    assert not glob.glob(os.path.join(ROOT, "benchmarks", "gpu_*.sh"))
    for needed in ("build-tests", "codec", "ring", "diloco-1b", "fidelity"):
        assert needed in SUITES
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "--list"], capture_output=True, text=True)
    assert p.returncode == 0 and all(s in p.stdout for s in SUITES)
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "no-such-suite", "/tmp/x"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "no suite 'no-such-suite'" in p.stdout


@pytest.mark.parametrize("suite", SUITES)
def test_suite_dry_run(suite, tmp_path):
    for path in (f"benchmarks/gpu/{suite}.sh", "benchmarks/gpu/common.sh", "benchmarks/gpu.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, path)]).returncode == 0, path
    p = _dry_run(suite, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"== summary of suite {suite}" in p.stdout and "dry run" in p.stdout, p.stdout
    assert "unbound variable" not in p.stderr and "command not found" not in p.stderr, p.stderr
    commands = [shlex.split(line.split(" > ")[0]) for line in p.stdout.splitlines() if line.startswith("   ")]
    assert commands, p.stdout
    for cmd in commands:
        if "python3" not in cmd:
            continue
        args = cmd[cmd.index("python3") + 1:]
        if args[0] == "-m" and args[1] in ("prime.simulate", "prime.train"):
            fields = args[args.index("--") + 1:] if "--" in args else args[2:]
            _check_config_flags(fields)
        elif args[0].endswith(".py") and args[0] != "setup.py":
            script = os.path.join(ROOT, args[0])
            assert os.path.isfile(script), args[0]
            source = open(script).read()
            own = args[1:args.index("--")] if "--" in args else args[1:]
            rest = args[len(own) + 2:]  # after "--": another program's (stop_job.py: prime-simulate's)
            if "--" in rest:  # a launcher's arguments, then prime-train's fields
                _check_config_flags(rest[rest.index("--") + 1:])
            for flag in (a.split("=")[0] for a in own if a.startswith("--")):
                if "." in flag or flag == "--config":  # the config passed through (bench_fidelity.py)
                    _check_config_flags([flag, "x"])
                else:
                    assert f'"{flag}"' in source, f"{args[0]} has no option {flag}"
        elif args[0] == "-m" and args[1] == "pytest":
            for target in (a for a in args[2:] if a.startswith("tests/")):
                path, _, name = target.partition("::")
                assert os.path.isfile(os.path.join(ROOT, path)), target
                if name:
                    assert re.search(rf"^def {name}\(", open(os.path.join(ROOT, path)).read(), re.M), target


def _check_config_flags(args):
    """Every --section.field names a config field (values are not checked: they hold shell-made paths)."""
    for flag in (a for a in args if a.startswith("--") and "." in a):
        field = flag[2:]
        try:
            load_config(None, [(field, "1")])
        except ValueError as e:
            assert "unknown config field" not in str(e), f"{flag}: {e}"


def test_an_unknown_diloco_variant_fails_the_suite(tmp_path):
    p = _dry_run("diloco-1b", tmp_path, VARIANTS="sync_3g")
    assert p.returncode == 1 and "unknown variant sync_3g" in p.stdout


def test_the_fidelity_suite_reads_the_standard_library_corpus_when_asked(tmp_path):
    p = _dry_run("fidelity", tmp_path, CORPUS="stdlib", TMPDIR=str(tmp_path), RUNS="1:diloco-int8-plain")
    assert p.returncode == 0, p.stdout + p.stderr
    corpus = tmp_path / "prime_stdlib_corpus"
    files = [f for _, _, names in os.walk(corpus) for f in names]
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in d for d, _, _ in os.walk(corpus))
    cmd = next(line for line in p.stdout.splitlines() if "bench_fidelity.py" in line and line.startswith("   "))
    assert f"--data.source text --data.path {corpus}" in cmd and "embedded" not in cmd
    archive = tmp_path / "corpus.tar.xz"  # the same corpus carried as an archive
    subprocess.run(["tar", "cJf", str(archive), "-C", str(corpus), "."], check=True)
    p = _dry_run("fidelity", tmp_path, CORPUS=str(archive), TMPDIR=str(tmp_path), RUNS="1:diloco-int8-plain")
    assert p.returncode == 0, p.stdout + p.stderr
    unpacked = tmp_path / "prime_corpus_corpus"
    assert sorted(f for _, _, names in os.walk(unpacked) for f in names) == sorted(files)
    assert f"--data.source text --data.path {unpacked}" in p.stdout
    p = _dry_run("fidelity", tmp_path, CORPUS="books")
    assert p.returncode == 2 and "CORPUS must be embedded, stdlib, a directory or a .tar.xz, got books" in p.stdout


def test_the_fidelity_suite_runs_the_low_rank_harness_when_asked(tmp_path):
    p = _dry_run("fidelity", tmp_path, BENCH="bench_lowrank", RUNS="1:int8,lowrank 2:lowrank-ef9")
    assert p.returncode == 0, p.stdout + p.stderr
    cmds = [shlex.split(line) for line in p.stdout.splitlines() if line.startswith("   ") and "CUDA_VISIBLE" in line]
    assert len(cmds) == 2 and all("benchmarks/bench_lowrank.py" in c for c in cmds), p.stdout
    assert [c[c.index("--methods") + 1] for c in cmds] == ["int8,lowrank", "lowrank-ef9"]
    p = _dry_run("fidelity", tmp_path, BENCH="bench_nothing")
    assert p.returncode == 2 and "BENCH must be bench_fidelity or bench_lowrank, got bench_nothing" in p.stdout


def test_the_fidelity_suite_reads_tokenized_shards_as_bin_data(tmp_path):
    shards = tmp_path / "bpe"  # prime-tokenize's output: the suite only looks for its meta.json
    shards.mkdir()
    (shards / "meta.json").write_text("{}")
    (shards / "shard_00000.bin").write_bytes(b"\0\0")
    p = _dry_run("fidelity", tmp_path, CORPUS=str(shards), RUNS="1:diloco-int8-plain")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"--data.source bin --data.path {shards}" in p.stdout and "--data.source text" not in p.stdout


def test_the_corpus_script_adds_installed_packages_and_names_a_missing_one(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import stdlib_corpus
    finally:
        sys.path.pop(0)
    alone = stdlib_corpus.build(str(tmp_path / "alone"))
    both = stdlib_corpus.build(str(tmp_path / "both"), ("json",))
    added = sorted(os.listdir(tmp_path / "both" / "site-packages" / "json"))
    assert "decoder.py" in added and both[0] == alone[0] + len(added) and both[1] > alone[1]
    with pytest.raises(SystemExit, match="'no_such_package_x' is not an installed package"):
        stdlib_corpus.build(str(tmp_path / "x"), ("no_such_package_x",))

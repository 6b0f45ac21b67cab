"""prime/faults.py: the named fault points, their specs and their actions (in milliseconds, plus two
subprocesses for the actions that end a process)."""

import os
import subprocess
import sys
import time

import pytest

from prime import faults
from prime.faults import FaultSpecError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(faults.LEGACY_EXIT_ENV, raising=False)
    faults.disarm()
    yield
    faults.disarm()


def test_specs_parse_into_points_triggers_and_actions():
    got = faults.parse("allreduce.inside@8, train.before_step@12=hold:/tmp/a:b,transfer.serve@0.4,"
                       "train.after_step@3,allreduce.inside@file:/tmp/die,ring.send@5000")
    assert [(f.point, f.at, f.path, f.action, f.arg) for f in got] == [
        ("allreduce.inside", 8.0, None, "kill", None),
        ("train.before_step", 12.0, None, "hold", "/tmp/a:b"),  # a path may hold ':'
        ("transfer.serve", 0.4, None, "kill", None),
        ("train.after_step", 3.0, None, "exit", "17"),
        ("allreduce.inside", None, "/tmp/die", "kill", None),
        ("ring.send", 5000.0, None, "corrupt", None),
    ]
    assert faults.parse("") == [] and faults.parse(" , ") == []


@pytest.mark.parametrize("spec, says", [
    ("nope@3", "no fault point 'nope'"),
    ("allreduce.inside", "expected POINT@AT"),
    ("allreduce.inside@", "expected POINT@AT"),
    ("allreduce.inside@x", "AT must be a number or file:PATH"),
    ("allreduce.inside@8=stall:3", "allreduce.inside cannot 'stall'"),
    ("train.before_step@3=stall", "stall needs SECONDS"),
    ("train.before_step@3=stall:soon", "stall takes a finite number"),
    ("train.before_step@3=stall:nan", "stall takes a finite number"),
    ("train.before_step@3=stall:inf", "stall takes a finite number"),
    ("train.after_step@3=exit:nan", "exit takes a finite number"),
    ("train.before_step@inf", "AT must be a number or file:PATH"),
    ("train.before_step@nan", "AT must be a number or file:PATH"),
    ("transfer.serve@-inf", "AT must be a number or file:PATH"),
    ("train.before_step@2.5", "whole number"),
    ("train.after_step@-1", "whole number"),
    ("train.after_step@3=exit:300", "out of range"),
    ("allreduce.inside@3=kill:now", "takes no argument"),
    ("ring.send@file:/tmp/x", "give a byte offset"),
    ("allreduce.inside@file:", "needs a path"),
])
def test_bad_specs_are_refused_naming_the_spec_and_what_is_accepted(spec, says):
    with pytest.raises(FaultSpecError) as e:
        faults.parse(f"allreduce.inside@1,{spec}")
    assert says in str(e.value) and repr(spec) in str(e.value), str(e.value)


def test_node_specs_of_prime_simulate():
    assert faults.parse_node_fault("2=allreduce.inside@8") == (2, "allreduce.inside@8")
    assert faults.parse_node_fault("allreduce.inside@8=kill") == (None, "allreduce.inside@8=kill")
    with pytest.raises(FaultSpecError):
        faults.parse_node_fault("2=allreduce:8")  # the old spelling is gone: one syntax


def test_equal_and_reached_triggers_fire_once(tmp_path):
    said = []
    faults.arm(f"train.before_step@3=stall:0,transfer.serve@0.5=kill")
    assert faults.hit("train.before_step", 2, log=said.append) is None
    f = faults.hit("train.before_step", 3, log=said.append)
    assert f is not None and f.action == "stall" and "stalling" in said[-1]
    assert faults.hit("train.before_step", 3, log=said.append) is None  # once
    assert faults.hit("train.after_step", 3) is None  # another point: nothing armed
    assert faults.armed("transfer.serve")[0].matches(0.7) and not faults.armed("transfer.serve")[0].matches(0.4)
    trig = tmp_path / "go"
    faults.arm(f"train.before_step@file:{trig}=stall:0")
    assert faults.hit("train.before_step", 9, log=said.append) is None
    trig.write_text("")
    assert faults.hit("train.before_step", 10, log=said.append) is not None


def test_hold_waits_for_its_file(tmp_path):
    path = tmp_path / "release"
    faults.arm(f"train.before_step@5=hold:{path}")
    said = []
    import threading

    t = threading.Timer(0.3, path.write_text, args=("",))
    t.start()
    t0 = time.monotonic()
    faults.hit("train.before_step", 5, log=said.append)
    assert time.monotonic() - t0 >= 0.25, said
    assert "holding at inner step 5" in said[0] and "released" in said[1]


def test_standing_faults_are_read_by_the_caller_and_never_fire():
    assert faults.standing("ring.send", "corrupt") is None
    faults.arm("ring.send@5000")
    assert faults.standing("ring.send", "corrupt").at == 5000
    assert faults.hit("ring.send", 10**9) is None


def _run(env_extra: dict, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    env.pop(faults.ENV, None) if faults.ENV not in env_extra else None
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_kill_and_exit_end_the_process_as_a_crash_would():
    code = ("from prime import faults\n"
            "for s in range(1, 10):\n"
            "    faults.hit('allreduce.inside', s, log=print)\n"
            "    print('survived', s, flush=True)\n")
    p = _run({faults.ENV: "allreduce.inside@4"}, code)
    assert p.returncode == -9 and "survived 3" in p.stdout and "survived 4" not in p.stdout, p
    assert "fault allreduce.inside@4: SIGKILL" in p.stdout
    code = ("from prime import faults\n"
            "faults.hit('train.after_step', 7, log=print, before_exit=lambda: print('flushed', flush=True))\n"
            "print('not reached')\n")
    p = _run({faults.LEGACY_EXIT_ENV: "7"}, code)  # the older variable still arms train.after_step
    assert p.returncode == 17 and "flushed" in p.stdout and "exiting as if killed" in p.stdout, p
    assert "not reached" not in p.stdout
    p = _run({faults.ENV: "train.after_step@7=exit:3"}, code)
    assert p.returncode == 3, p


def test_a_bad_spec_in_the_environment_fails_at_the_first_fault_point():
    p = _run({faults.ENV: "allreduce.inside@soon"}, "from prime import faults\nfaults.hit('allreduce.inside', 1)\n")
    assert p.returncode != 0 and "AT must be a number" in p.stderr, p.stderr[-2000:]


def test_prime_simulate_checks_fault_specs_before_starting_anything():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "prime.simulate", "--nodes", "2", "--fault", "1=allreduce.inside@x",
                        "--", "--config", "configs/tiny.toml"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "--fault 1=allreduce.inside@x" in p.stderr and "AT must be" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "prime.simulate", "--nodes", "2", "--fault", "5=allreduce.inside@3",
                        "--", "--config", "configs/tiny.toml"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "there is no node 5" in p.stderr, p.stderr

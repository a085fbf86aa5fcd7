"""The code sandbox against a policy that games its reward: every case runs under each
isolation level that works on this machine (the level is in the test id).

Two kinds of case. **Forgeries** (printed or written result lines, rigged equality, early
exit, patched builtins, runner or import system, the tests read from memory) answer wrongly
and try to be scored anyway: they must score what their honest answers earn. **Escapes**
(writes to shared temporary directories, deleting a sibling execution's directory, network,
a host's named unix socket, processes left behind, inherited descriptors, the parent's /proc,
the environment) return the right answer only when the attack failed, so they score 1.0
exactly when contained, and the machine is checked afterwards. Network cases use loopback
sockets of this test only. Cells docs/rewards.md lists as not stopped (limits alone) are
skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from rollwise.rewards import sandbox as sb
from rollwise.rewards.sandbox import run_tests
from test_sandbox import LEVELS, LIMITS, ROOT, TESTS, _sandbox_processes

SECRET = "rollwise-hostile-secret-5c2e"



# ---------------------------------------------------------------------------------------------
# Forgeries: wrong answers that try to be scored anyway

FORGE_LINES = (
    "import json, os, sys\n"
    "def _forge():\n"
    "    for i in range(4):\n"
    "        for line in (json.dumps({'passed': i}), json.dumps({'done': True}), 'pass %d' % i):\n"
    "            data = (line + '\\n').encode()\n"
    "            print(line)\n"
    "            sys.stderr.write(line + '\\n')\n"
    "            for fd in range(64):\n"
    "                try:\n"
    "                    os.write(fd, data)\n"
    "                except OSError:\n"
    "                    pass\n"
    "            for pid in (os.getppid(), 1, 2):\n"
    "                for fd in (1, 2):\n"
    "                    try:\n"
    "                        with open(f'/proc/{pid}/fd/{fd}', 'w') as out:\n"
    "                            out.write(line + '\\n')\n"
    "                    except OSError:\n"
    "                        pass\n"
)
FORGERIES = {
    # result-like lines on stdout, stderr, every descriptor and the runner's /proc fds
    "print_result_lines": FORGE_LINES + "_forge()\ndef f(x):\n    _forge()\n    return None\n",
    # an object whose __eq__ always agrees
    "rigged_eq": ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                  "    def __ne__(self, other):\n        return False\n    __hash__ = None\n"
                  "def f(x):\n    return Yes()\n"),
    # a subclass of int with a rigged comparison
    "int_subclass": ("class Int(int):\n    def __eq__(self, other):\n        return True\n"
                     "    __hash__ = int.__hash__\n"
                     "def f(x):\n    return Int(0)\n"),
    # an object that pretends to be a str / number
    "pretender": ("class Fake:\n    __class__ = int\n    def __eq__(self, other):\n"
                  "        return True\n    def __index__(self):\n        return 0\n"
                  "def f(x):\n    return Fake()\n"),
    # ends its process during the first call
    "early_exit": "import os\ndef f(x):\n    os._exit(0)\n",
    "sys_exit": "import sys\ndef f(x):\n    sys.exit(0)\n",
    # patches builtins the tests would use, then answers wrongly
    "builtins_patch": ("import builtins\n"
                       "builtins.AssertionError = type('Never', (BaseException,), {})\n"
                       "builtins.compile = lambda *a, **k: None\n"
                       "builtins.exec = lambda *a, **k: None\n"
                       "builtins.isinstance = lambda *a: True\n"
                       "def f(x):\n    return None\n"),
    # patches the runner's own functions in its memory, and the import system
    "runner_patch": ("import sys\n"
                     "runner = sys.modules.get('rollwise.rewards.runner')\n"
                     "canonical = sys.modules.get('rollwise.rewards.canonical')\n"
                     "if runner is not None and canonical is not None:\n"
                     "    runner.decode = canonical.decode = lambda *a, **k: 1\n"
                     "    runner.Link.call = lambda *a, **k: 1\n"
                     "    runner._run = lambda *a, **k: None\n"
                     "    runner.encode = canonical.encode = lambda value, depth=0: ['i', '1']\n"
                     "class Finder:\n"
                     "    def find_spec(self, *a, **k):\n        raise ImportError('no')\n"
                     "sys.meta_path.insert(0, Finder())\n"
                     "sys.modules['json'] = None\n"
                     "def f(x):\n    return None\n"),
    # signals the runner and its own group, then answers wrongly
    "signal_runner": ("import os, signal\n"
                      "def f(x):\n"
                      "    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):\n"
                      "        for target in (os.getppid(), 1):\n"
                      "            try:\n                os.kill(target, sig)\n"
                      "            except OSError:\n                pass\n"
                      "    return None\n"),
    # looks for the tests (and their expected values) in its own memory
    "tests_from_memory": ("import gc, re, sys\n"
                          "def _texts():\n"
                          "    seen = []\n"
                          "    for obj in gc.get_objects():\n"
                          "        values = obj.values() if isinstance(obj, dict) else obj "
                          "if isinstance(obj, (list, tuple)) else ()\n"
                          "        seen += [v for v in values if isinstance(v, (str, bytes))]\n"
                          "    return ' '.join(v if isinstance(v, str) else "
                          "v.decode('latin-1') for v in seen)\n"
                          "def f(x):\n"
                          "    found = re.search(r'candidate\\(%d\\) == (-?\\d+)' % x, _texts())\n"
                          "    return int(found.group(1)) if found else None\n"),
}
# honest partial credit: passes two tests, then ends its process
EXIT_AFTER_TWO = "import os\ndef f(x):\n    if x >= 2:\n        os._exit(0)\n    return x + 1\n"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_forgery_scores_what_its_answers_earn(case, level) -> None:
    result = run_tests(FORGERIES[case], TESTS, "f", LIMITS, isolation=level)
    assert (result.passed, result.total, result.score) == (0, 4, 0.0), result
    # (a runner the code could stop, as the same user under limits alone, times out)
    assert result.status in ("failed", "crashed", "load_error", "timeout"), result


@pytest.mark.parametrize("level", LEVELS)
def test_early_exit_keeps_only_the_honest_passes(level) -> None:
    result = run_tests(EXIT_AFTER_TWO, TESTS, "f", LIMITS, isolation=level)
    assert (result.passed, result.total, result.status) == (2, 4, "crashed"), result
    # right answers count once each, whatever result-like lines the code prints
    printing = ("import json, sys\ndef f(x):\n"
                "    for i in range(50):\n"
                "        print(json.dumps({'passed': i % 4}))\n"
                "        sys.stderr.write(json.dumps({'passed': i % 4}) + '\\n')\n"
                "    return x + 1\n")
    forged = run_tests(printing, TESTS, "f", LIMITS, isolation=level)
    assert (forged.passed, forged.total, forged.status) == (4, 4, "ok"), forged


def test_the_tests_never_reach_the_code_and_values_are_canonical() -> None:
    """The runner's codec: exact built-in types only, rebuilt as genuine objects."""
    from rollwise.rewards import canonical

    value = {"a": [1, 2.5, (None, True)], 3: {frozenset({1}), b"x"}, "c": complex(1, -1)}
    assert canonical.decode(canonical.encode(value)) == value
    for bad in (len, object(), type("I", (int,), {})(1), type("S", (str,), {})("a")):
        with pytest.raises(TypeError):
            canonical.encode(bad)
    for forged in (["i", 1], "i1", "i1;x", "x1;", "l2:i1;", "s5:ab", "d1:N", "i--1;", "fabc;",
                   "l999999999:", "i" + "9" * 6000 + ";", "b3:zz"):
        with pytest.raises(ValueError):
            canonical.decode(forged)


# ---------------------------------------------------------------------------------------------
# Escapes: the right answer only when the attack failed


def _not_stopped(case: str, level: str) -> str:
    """Why `case` is not stopped under `level` (docs/rewards.md's table), else ''."""
    if level != "rlimits":
        return ""
    if case in ("shared_temp_write", "sibling_deletion"):
        return "limits alone share the file system (docs/rewards.md)"
    if case in ("network", "unix_socket") and not sb._layers(level)["seccomp"]:
        return "limits without seccomp share the network (docs/rewards.md)"
    if case == "parent_proc" and not ROOT:
        return "limits alone, as the same user, can read that user's /proc (docs/rewards.md)"
    return ""


def _escape_code(case: str, ctx: dict) -> str:
    """The attack of `case`, then ``return x + 1`` if it failed, else a wrong answer."""
    if case == "shared_temp_write":
        paths = [f"{d}/{ctx['marker']}" for d in ("/tmp", "/var/tmp", "/dev/shm")]
        return ("def f(x):\n"
                f"    for path in {paths!r}:\n"
                "        try:\n            open(path, 'w').write('x')\n"
                "        except OSError:\n            pass\n"
                "    return x + 1\n")  # judged by the files left on the host
    if case == "sibling_deletion":
        return ("import os, shutil\n"
                "def f(x):\n"
                f"    victim = {ctx['victim']!r}\n"
                "    shutil.rmtree(victim, ignore_errors=True)\n"
                "    try:\n        names = os.listdir(os.path.dirname(victim))\n"
                "    except OSError:\n        names = []\n"
                "    return x + 1 if os.path.basename(victim) not in names else -1\n")
    if case == "network":
        return ("import socket\n"
                "def f(x):\n"
                "    try:\n"
                f"        socket.create_connection(('127.0.0.1', {ctx['tcp']}), timeout=0.5)\n"
                "        return -1\n"
                "    except OSError:\n        pass\n"
                "    try:\n"
                "        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"        s.sendto(b'leak', ('127.0.0.1', {ctx['udp']}))\n"
                "    except OSError:\n        pass\n"
                "    return x + 1\n")  # the datagram is judged on the receiving side
    if case == "unix_socket":
        return ("import socket\n"
                "def f(x):\n"
                "    try:\n"
                "        s = socket.socket(socket.AF_UNIX)\n"
                f"        s.connect({ctx['unix']!r})\n"
                "        s.send(b'leak')\n"
                "        return -1\n"
                "    except OSError:\n        return x + 1\n")
    if case == "lingering_setsid":
        return ("import os, time\n"
                "def f(x):\n"
                "    if x == 0 and os.fork() == 0:\n"
                "        try:\n            os.setsid()\n"
                "        except OSError:\n            pass\n"
                "        if os.fork() == 0:\n            time.sleep(30)\n"
                "        os._exit(0)\n"
                "    return x + 1\n")
    if case == "fd_inheritance":
        return ("import os\n"
                "def f(x):\n"
                "    for fd in range(3, 1024):\n"
                "        try:\n"
                f"            if {SECRET!r}.encode() in os.pread(fd, 4096, 0):\n"
                "                return -1\n"
                "        except OSError:\n            pass\n"
                "    return x + 1\n")
    if case == "secret_env":
        return ("import os\n"
                "def f(x):\n"
                "    print(os.environ)\n"
                f"    return -1 if {SECRET!r} in str(os.environ) else x + 1\n")
    if case == "parent_proc":
        return ("import os\n"
                "def f(x):\n"
                "    found = ''\n"
                f"    for pid in ({ctx['me']}, os.getppid(), 1, 'self'):\n"
                "        for name in ('environ', 'cmdline'):\n"
                "            try:\n"
                "                found += open(f'/proc/{pid}/{name}', 'rb').read().decode("
                "'latin-1')\n"
                "            except OSError:\n                pass\n"
                f"    if {SECRET!r} in found:\n"
                "        print(found)\n        return -1\n"
                "    return x + 1\n")
    raise KeyError(case)


ESCAPES = ("shared_temp_write", "sibling_deletion", "network", "unix_socket", "lingering_setsid",
           "fd_inheritance", "parent_proc", "secret_env")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", ESCAPES)
def test_escape_is_contained(case, level, monkeypatch) -> None:
    why = _not_stopped(case, level)
    if why:
        pytest.skip(why)
    monkeypatch.setenv("ROLLWISE_HOSTILE_SECRET", SECRET)
    marker = f"rollwise-hostile-{os.getpid()}-{time.monotonic_ns()}"
    victim = tempfile.mkdtemp(prefix="rollwise-sbx-victim-")
    Path(victim, "keep.txt").write_text("precious")
    if ROOT:  # a concurrent execution's directory: owned by the same user as the code
        for path in (victim, f"{victim}/keep.txt"):
            os.chown(path, sb.NOBODY, sb.NOBODY)
    with tempfile.TemporaryFile() as secret_file, socket.socket() as tcp, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
            socket.socket(socket.AF_UNIX) as unix:
        secret_file.write(SECRET.encode())
        secret_file.flush()
        os.set_inheritable(secret_file.fileno(), True)  # the sandbox must not inherit it
        for sock in (tcp, udp):
            sock.bind(("127.0.0.1", 0))
        unix.bind(f"{victim}.sock")  # a host service on a named unix socket
        os.chmod(f"{victim}.sock", 0o777)
        for sock in (tcp, udp, unix):
            sock.settimeout(0.02)  # anything the code sent is queued before the run ends
        tcp.listen(1)
        unix.listen(1)
        ctx = {"marker": marker, "victim": victim, "tcp": tcp.getsockname()[1],
               "udp": udp.getsockname()[1], "unix": f"{victim}.sock", "me": os.getpid()}
        try:
            result = run_tests(_escape_code(case, ctx), TESTS, "f", LIMITS, isolation=level)
            time.sleep(0.1)
            assert _sandbox_processes() == []  # nothing left running
            for d in ("/tmp", "/var/tmp", "/dev/shm"):
                assert not Path(d, marker).exists(), d
            assert Path(victim, "keep.txt").read_text() == "precious"
            with pytest.raises(TimeoutError):
                tcp.accept()
            with pytest.raises(TimeoutError):
                udp.recvfrom(16)
            with pytest.raises(TimeoutError):
                unix.accept()
            assert SECRET not in result.output
            assert result.score == 1.0 and result.status == "ok", result
        finally:
            shutil.rmtree(victim, ignore_errors=True)
            Path(f"{victim}.sock").unlink(missing_ok=True)


@pytest.mark.parametrize("level", LEVELS)
def test_honest_lazy_imports_work(level) -> None:
    """Standard-library modules that import others lazily, whoever runs the trainer and
    wherever the interpreter lives (the code's process may run as nobody)."""
    code = ("import datetime, importlib\n"
            "from fractions import Fraction\n"
            "import xml.etree.ElementTree as ET\n"
            "def f(x):\n"
            "    datetime.datetime.strptime('2024-03-04', '%Y-%m-%d')\n"
            "    assert ET.fromstring('<a><b/></a>').find('b') is not None\n"
            "    importlib.import_module('decimal').Decimal('1.5')\n"
            "    'caf\\u00e9'.encode('cp1252')\n"
            "    return int(Fraction(x + 1, 1))\n")
    result = run_tests(code, TESTS, "f", LIMITS, isolation=level)
    assert (result.status, result.score) == ("ok", 1.0), result


def test_startup_line_names_the_layers() -> None:
    info = sb.isolation_info()
    assert info["isolation"] in sb.ISOLATION_LEVELS and info["layers"]
    assert "verdict outside the code's process" in info["layers"]
    assert info["security_boundary"] == (info["isolation"] in sb.SECURITY_BOUNDARY)

"""What every launch of the script imports, imported once per test process: conftest.launch
forks each launch from a multiprocessing forkserver that preloads this module, so a launch is
a process of its own that runs the script file as `python SCRIPT ARGS` does, without the ~4 s
(quiet; ~8 s of CPU on a busy machine) that a fresh interpreter spends importing torch,
torch._dynamo (which the optimizer pulls in), gymnasium, ALE and TensorBoard. Left out: the
interpreter's start-up and those imports (a signal during them, the `--help` of a fresh
process); tests of those start the script with subprocess."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the script sets it before torch loads
import atexit  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

import ale_py  # noqa: E402, F401
import cv2  # noqa: E402, F401
import gymnasium  # noqa: E402, F401
import numpy  # noqa: E402, F401
import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import tyro  # noqa: E402, F401
from torch.utils.tensorboard import SummaryWriter  # noqa: E402, F401


def run_as_main(script, args, cwd, env, out, err, new_session, sigint_ignored):
    """In the forked child: the state a fresh `python SCRIPT ARGS` starts in (working folder,
    environment, stdout and stderr files, signal dispositions, its own session if asked), then
    the script as __main__, then an exit as the interpreter's: an uncaught exception's
    traceback and exit code 1, SystemExit's code, threads joined, atexit handlers run."""
    if new_session:
        os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script, *args]
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

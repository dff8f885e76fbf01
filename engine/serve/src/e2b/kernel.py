# Strata's code-interpreter kernel: one IPython shell per context, run by the sandbox's own python3 and driven
# by the server over two pipes (engine/serve/src/e2b/kernel.rs). Everything the server reads from here is
# checked there: this file runs beside the user's code and is trusted no more than it is.
#
# Requests arrive on stdin, one JSON object a line:
#   {"op": "execute", "code": "...", "env": {"K": "V"}}   runs a cell (env: for this cell only)
#   {"op": "interrupt"}                                    KeyboardInterrupt in the running cell, if any
# Events leave on the process's original stdout, one JSON object a line:
#   {"type": "ready"}                                      once, when the shell is up
#   {"type": "number_of_executions", "execution_count": n} at the start of a cell
#   {"type": "stdout" | "stderr", "text": "..."}           output as the cell writes it (Python's and its
#                                                          subprocesses', through file descriptors 1 and 2)
#   {"type": "result", "is_main_result": bool, "text": ..., "html": ..., "png": ..., ...}
#   {"type": "error", "name": ..., "value": ..., "traceback": ...}
#   {"type": "end_of_execution"}                           the cell is done and its output drained
# The bash language runs its cells in one bash process that lives as long as the context (its variables and
# directory carry over), with the same events.
import base64
import codecs
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading

LANGUAGE = sys.argv[1] if len(sys.argv) > 1 else "python"

# An interrupt is how the server stops a cell: SIGINT must raise KeyboardInterrupt here, and reach bash as its
# default action, even when the process that started this one ignored it (Python keeps an inherited SIG_IGN, and so
# would every program it starts).
signal.signal(signal.SIGINT, signal.default_int_handler)

# The protocol's own descriptors, kept from the user's code and its children (non-inheritable): requests come
# on a copy of stdin, events go to a copy of stdout. The cell's fd 0 is /dev/null, fds 1 and 2 are pipes read
# here, so that `!cmd`, os.system and C extensions' output are the cell's output too.
_requests = os.fdopen(os.dup(0), "rb", buffering=0)
_events = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace", buffering=1)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
_pipes = {}
for _fd, _name in ((1, "stdout"), (2, "stderr")):
    _r, _w = os.pipe()
    os.dup2(_w, _fd)
    os.close(_w)
    os.set_blocking(_r, False)
    _pipes[_r] = (_name, codecs.getincrementaldecoder("utf-8")(errors="replace"))
sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
sys.stdin = open(0, "r", closefd=False)

_lock = threading.Lock()


def emit(event):
    line = json.dumps(event, default=repr)
    with _lock:
        _events.write(line + "\n")
        _events.flush()


def _drain_locked():
    """Reads what fds 1 and 2 hold now and emits it (the caller holds the lock)."""
    for fd, (name, decoder) in _pipes.items():
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            text = decoder.decode(chunk)
            if text:
                _events.write(json.dumps({"type": name, "text": text}) + "\n")
    _events.flush()


def drain():
    """Flushes Python's streams, then emits everything written to fds 1 and 2 so far."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    with _lock:
        _drain_locked()


def _pump():
    """Streams fds 1 and 2 as the cell writes them. Reads happen under the lock, so `drain` misses nothing."""
    while True:
        ready, _, _ = select.select(list(_pipes), [], [], 0.05)
        if ready:
            with _lock:
                _drain_locked()


threading.Thread(target=_pump, name="strata-output", daemon=True).start()

_cells = queue.Queue()
# `pending`: cells received and not yet ended; `cancel_next`: an interrupt came for a cell not yet running (it is
# received before it runs: the server interrupts the cell it sent last), so that cell ends at once when it starts.
_state = {"running": False, "pending": 0, "cancel_next": False}
_main = threading.main_thread().ident


def _read_requests():
    for line in _requests:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if not isinstance(request, dict):
            continue
        if request.get("op") == "interrupt":
            with _lock:
                if _state["running"]:
                    signal.pthread_kill(_main, signal.SIGINT)
                elif _state["pending"]:
                    _state["cancel_next"] = True
        elif request.get("op") == "execute":
            with _lock:
                _state["pending"] += 1
            _cells.put(request)
    _cells.put(None)


def _with_env(env, run):
    """Runs `run()` with the cell's environment variables set, then puts the previous values back."""
    saved = {}
    for key, value in _valid_env(env):
        saved[key] = os.environ.get(key)
        os.environ[key] = value
    try:
        return run()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# E2B's result fields, by MIME type; any other type goes to `extra`.
FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def result_event(data, main):
    event = {"type": "result", "is_main_result": bool(main)}
    extra = {}
    for mime, value in (data or {}).items():
        if isinstance(value, (bytes, bytearray)):
            value = base64.b64encode(value).decode("ascii")
        field = FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        elif field == "json" and not isinstance(value, dict):
            extra[mime] = value
        else:
            event[field] = value
    if extra:
        event["extra"] = extra
    return event


def python_kernel():
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    class Publisher(DisplayPublisher):
        """`display()` and inline figures: a result that is not the cell's value."""

        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            drain()
            emit(result_event(data, False))

        def clear_output(self, wait=False):
            pass

    class Hook(DisplayHook):
        """The value of the cell's last expression: its main result."""

        def start_displayhook(self):
            pass

        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            drain()
            event = result_event(format_dict, True)
            data = _table(self.shell.user_ns.get("_"))
            if data is not None:
                event["data"] = data
            emit(event)

        def finish_displayhook(self):
            pass

    def _table(value):
        """A pandas DataFrame's columns and rows as E2B's `data` (when small enough to be worth it)."""
        pandas = sys.modules.get("pandas")
        if pandas is None or not isinstance(value, pandas.DataFrame) or value.size > 10000:
            return None
        try:
            return json.loads(value.to_json(orient="split", date_format="iso"))
        except Exception:
            return None

    class Shell(InteractiveShell):
        def _showtraceback(self, etype, evalue, stb):
            drain()
            emit({
                "type": "error",
                "name": getattr(etype, "__name__", str(etype)),
                "value": str(evalue),
                "traceback": "\n".join(stb),
            })

    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    shell = Shell.instance(config=config, display_pub_class=Publisher, displayhook_class=Hook, colors="NoColor")
    # `!cmd` through a shell whose output goes to fd 1, which is the cell's stdout.
    shell.system = shell.system_raw
    emit({"type": "ready"})

    def run(code, env):
        _with_env(env, lambda: shell.run_cell(code, store_history=True))

    return shell, run


def bash_kernel():
    """One bash for the context's life (its variables and directory carry over): each cell is sourced from a file
    with the cell's variables set for it, then bash writes the cell's status to a pipe of ours."""
    import tempfile

    done_r, done_w = os.pipe()
    bash = subprocess.Popen(
        ["/bin/bash", "--noprofile", "--norc"],
        stdin=subprocess.PIPE,
        pass_fds=(done_w,),
        start_new_session=True,
    )
    # An interrupt stops the cell, never the shell: a trap (not an ignore, which children would inherit) that returns
    # from the sourced cell (its foreground command got the signal too); between cells it does nothing. Ready only
    # once bash has set it (an interrupt before that would end the shell).
    bash.stdin.write(b"trap 'return 130 2>/dev/null' INT; echo 0 >&%d\n" % done_w)
    bash.stdin.flush()
    os.close(done_w)

    def status(deadline=None):
        got = b""
        while not got.endswith(b"\n"):
            ready, _, _ = select.select([done_r], [], [], deadline)
            if not ready:
                return None
            chunk = os.read(done_r, 64)
            if not chunk:
                raise EOFError("the bash of this context ended")
            got += chunk
        return int(got.strip() or b"1")

    status()
    emit({"type": "ready"})

    def run(code, env):
        with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as script:
            script.write(code)
            path = script.name
        assignments = "".join("%s=%s " % (k, _quote(v)) for k, v in _valid_env(env))
        try:
            bash.stdin.write(("%s. %s; echo \"$?\" >&%d\n" % (assignments, _quote(path), done_w)).encode())
            bash.stdin.flush()
            try:
                code = status()
            except KeyboardInterrupt:
                # The interrupt can reach bash before it runs the cell (while it reads the cell's line), when the
                # trap has nothing to return from: interrupt again until the cell's status comes.
                for _ in range(50):
                    os.killpg(bash.pid, signal.SIGINT)
                    if status(0.1) is not None:
                        raise
                raise EOFError("the bash of this context did not stop on interrupt")
        finally:
            os.unlink(path)
        if code != 0:
            drain()
            emit({"type": "error", "name": "BashError", "value": "exit status %d" % code, "traceback": ""})

    return None, run


def _valid_env(env):
    """The cell's variables that are well-formed names and values."""
    if not isinstance(env, dict):
        return []
    return [
        (k, v)
        for k, v in env.items()
        if isinstance(k, str) and isinstance(v, str) and k and not k[:1].isdigit()
        and k.replace("_", "a").isascii() and k.replace("_", "a").isalnum() and "\0" not in v
    ]


def _quote(value):
    return "'" + value.replace("'", "'\\''") + "'"


def main():
    if LANGUAGE == "python":
        shell, run = python_kernel()
    else:
        shell, run = bash_kernel()
    count = 0
    threading.Thread(target=_read_requests, name="strata-requests", daemon=True).start()
    while True:
        request = _cells.get()
        if request is None:
            return
        count = shell.execution_count if shell is not None else count + 1
        emit({"type": "number_of_executions", "execution_count": count})
        code = request.get("code")
        try:
            with _lock:
                _state["running"] = True
                cancelled, _state["cancel_next"] = _state["cancel_next"], False
            if cancelled:
                raise KeyboardInterrupt
            run(code if isinstance(code, str) else "", request.get("env"))
        except KeyboardInterrupt:
            drain()
            emit({"type": "error", "name": "KeyboardInterrupt", "value": "", "traceback": "KeyboardInterrupt"})
        except EOFError as error:  # the context's bash is gone: this kernel ends, the server starts a new one
            drain()
            emit({"type": "error", "name": "KernelDied", "value": str(error), "traceback": ""})
            emit({"type": "end_of_execution"})
            sys.exit(3)
        except BaseException as error:  # the kernel's own failure: reported, the kernel goes on
            drain()
            emit({"type": "error", "name": type(error).__name__, "value": str(error), "traceback": ""})
        finally:
            with _lock:
                _state["running"] = False
                _state["pending"] -= 1
        try:
            drain()
        except KeyboardInterrupt:
            drain()
        emit({"type": "end_of_execution"})


main()

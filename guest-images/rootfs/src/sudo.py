#!/usr/bin/python3 -I
"""sudo for Strata's process-tier sandboxes.

A job cannot gain privileges by exec (no_new_privs), so this is not a set-user-ID program: it asks the sandbox's
PID 1 over /run/strata/sudo.sock to run the command as the sandbox's root, with this process's standard streams,
and waits for it, forwarding the signals it gets. PID 1 decides who may (root and the `sudo` group, by the
kernel's peer credentials). Only `-u root` is supported.
"""
import json
import os
import signal
import socket
import sys

SOCKET = "/run/strata/sudo.sock"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGCONT, signal.SIGTSTP)
USAGE = "usage: sudo [-EHnS] [-i | -s] [-u root] [--] [command [arg ...]]"


def fail(message, code=1):
    sys.stderr.write(f"sudo: {message}\n")
    sys.exit(code)


def parse(args):
    login = shell = keep_env = False
    while args and args[0].startswith("-") and args[0] != "-":
        opt = args.pop(0)
        if opt == "--":
            break
        if opt in ("-u", "--user"):
            if not args:
                fail("option requires an argument -- 'u'")
            user = args.pop(0)
        elif opt.startswith("-u"):
            user = opt[2:]
        elif opt.startswith("--user="):
            user = opt[len("--user="):]
        elif opt in ("-i", "--login"):
            login = True
            continue
        elif opt in ("-s", "--shell"):
            shell = True
            continue
        elif opt in ("-E", "--preserve-env"):
            keep_env = True
            continue
        elif opt in ("-H", "--set-home", "-n", "--non-interactive", "-S", "--stdin", "-k", "--reset-timestamp"):
            continue
        elif opt in ("-h", "--help"):
            print(USAGE)
            sys.exit(0)
        elif opt in ("-V", "--version"):
            print("Strata sudo (asks the sandbox's PID 1)")
            sys.exit(0)
        else:
            fail(f"unsupported option {opt}\n{USAGE}")
        if user not in ("root", "0", "#0"):
            fail(f"only root is supported here, not {user!r}")
    return args, login, shell, keep_env


def main():
    args, login, shell, keep_env = parse(sys.argv[1:])
    env = dict(os.environ)
    if login:
        env = {k: v for k, v in env.items() if k in ("TERM", "LANG", "LC_ALL", "PATH", "DISPLAY", "COLORTERM")}
    if not keep_env or login:
        env.update(HOME="/root", USER="root", LOGNAME="root")
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env["SUDO_USER"] = os.environ.get("USER", str(os.getuid()))
    env["SUDO_UID"], env["SUDO_GID"] = str(os.getuid()), str(os.getgid())
    if login or shell:
        argv = ["/bin/bash"] + (["-l"] if login else []) + (["-c", " ".join(args)] if args else [])
    elif args:
        argv = args
    else:
        fail(USAGE)
    cwd = "/root" if login else os.getcwd()
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open("/dev/null", os.O_RDWR))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(SOCKET)
    except OSError as err:
        fail(f"cannot reach the sandbox's PID 1 at {SOCKET}: {err.strerror}")
    request = {"argv": argv, "env": sorted([k, v] for k, v in env.items()), "cwd": cwd}
    socket.send_fds(conn, [json.dumps(request).encode()], fds)

    def forward(number, _frame):
        try:
            conn.send(json.dumps({"Signal": number}).encode())
        except OSError:
            pass

    for number in FORWARDED:
        signal.signal(number, forward)
    while True:
        data = conn.recv(65536)
        if not data:
            fail("the sandbox's PID 1 went away")
        reply = json.loads(data)
        if "Refused" in reply:
            fail(reply["Refused"])
        if "Exited" in reply:
            ended = reply["Exited"]
            if ended.get("signal"):
                number = ended["signal"]
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)
                sys.exit(128 + number)
            sys.exit(ended.get("code") or 0)


if __name__ == "__main__":
    main()

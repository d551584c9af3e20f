# Run as machine root inside a machine: every way Linux offers to take another process's file descriptors or
# memory, tried against the guest agent and the machine's first process (tini). Prints one JSON object:
# {target: {probe: "ok" | errno name}}. Used by machine-root.test.ts.
import ctypes, errno, json, os, subprocess

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438
PTRACE_DETACH, PTRACE_SEIZE = 17, 0x4206


def err():
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def targets():
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        line = cmdline(int(name))
        if int(name) == 1:
            found["init"] = 1
        elif "agent/agent.cjs" in line and "agent" not in found:
            found["agent"] = int(name)
    return found


def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def probe(pid):
    out = {}
    pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        out["pidfd_open"] = err()
    else:
        out["pidfd_open"] = "ok"
        got = []
        last = "EBADF"
        for fd in range(0, 64):
            r = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
            if r >= 0:
                got.append(fd)
                os.close(r)
            else:
                e = err()
                if e != "EBADF":
                    last = e
        out["pidfd_getfd"] = "ok" if got else last
        os.close(pidfd)
    r = libc.ptrace(PTRACE_SEIZE, pid, None, None)
    if r == 0:
        out["ptrace"] = "ok"
        libc.ptrace(PTRACE_DETACH, pid, None, None)
    else:
        out["ptrace"] = err()
    out["mem"] = attempt(lambda: open(f"/proc/{pid}/mem", "rb").close())
    out["environ"] = attempt(lambda: open(f"/proc/{pid}/environ", "rb").read())
    out["fd_dir"] = attempt(lambda: os.listdir(f"/proc/{pid}/fd"))
    out["fd_open"] = attempt(lambda: os.close(os.open(f"/proc/{pid}/fd/1", os.O_WRONLY | os.O_APPEND)))
    out["root"] = attempt(lambda: os.listdir(f"/proc/{pid}/root/"))
    return out


# A control: a process of machine root's own, which every probe must reach (so a refusal above means something).
control = subprocess.Popen(["sleep", "60"])
found = targets()
found["control"] = control.pid
try:
    print(json.dumps({name: probe(pid) for name, pid in found.items()}))
finally:
    control.kill()

# The bridge between Kiln's guest agent and one IPython kernel: it starts the kernel with jupyter_client, speaks
# the Jupyter messaging protocol to it, and speaks JSON lines with the agent (commands on stdin, frames on fd 1).
#
# agent -> bridge: {"op": "execute", "code": str, "envs"?: {}} | {"op": "environ", "envs": {}} | {"op": "interrupt"}
#                  | {"op": "shutdown"}
# bridge -> agent: {"type": "ready", "kernel_pid": int} | {"type": "fatal", "error": str}
#                  {"type": "stdout"|"stderr", "text"} | {"type": "result", "data", "is_main_result", "execution_count"}
#                  {"type": "error", "name", "value", "traceback"} | {"type": "done", "execution_count", "status"}
# Executes run one at a time, in arrival order; an interrupt reaches the kernel at once (SIGINT via the manager).
# One thread: stdin is polled with the kernel's sockets, so a command is read the moment it arrives (a reader thread
# handing executes over through a queue cost a thread wake-up and a GIL hand-over on every execute).

import collections
import hmac
import json
import os
import re
import select
import sys
import time

# Frames go to a private copy of fd 1; fd 1 itself becomes stderr, so nothing the kernel (or a library) prints at
# the file-descriptor level can corrupt the protocol stream.
_proto = os.dup(1)
os.dup2(2, 1)
# Not blocking: while the agent does not read (its caller is slow), the agent's commands are still read (an interrupt).
os.set_blocking(_proto, False)
_commands = None
_ansi = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# Frames wait here until the bridge would wait for the kernel (at most HOLD_MS), an execute is done, or they add up to
# FRAME_TEXT: the frames of a short execute (its result and done) reach the agent in one write, one wake-up.
_out = []
_out_bytes = 0
_out_since = 0.0
HOLD_MS = 5


def emit(frame):
    global _out_bytes, _out_since
    data = (json.dumps(frame, ensure_ascii=False) + "\n").encode("utf-8")
    if not _out:
        _out_since = time.monotonic()
    _out.append(data)
    _out_bytes += len(data)
    if _out_bytes >= FRAME_TEXT:
        flush_frames()


def flush_frames():
    global _out_bytes
    if not _out:
        return
    data = b"".join(_out)
    _out.clear()
    _out_bytes = 0
    while data:
        try:
            data = data[os.write(_proto, data) :]
        except BlockingIOError:
            wait_writable()


def wait_writable():
    """Until the agent reads again; its commands are handled meanwhile."""
    poller = select.poll()
    poller.register(_proto, select.POLLOUT)
    listening = _commands is not None and not _commands.stopping
    if listening:
        poller.register(_commands.fd, select.POLLIN)
    for fd, _ in poller.poll():
        if listening and fd == _commands.fd:
            _commands.read()


# ipykernel sends what a cell printed in one message per flush (0.2 s): megabytes from a cell that floods. Frames
# carry at most this much text, so the agent never holds more than a few small frames of a caller that does not read.
FRAME_TEXT = 64 * 1024


def emit_text(kind, text):
    for at in range(0, len(text), FRAME_TEXT) or [0]:
        emit({"type": kind, "text": text[at : at + FRAME_TEXT]})


def bundle(data):
    # MIME bundles as strings: image/png is already base64 text; JSON-valued types are serialised.
    return {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in data.items()}


def main():
    cwd = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    try:
        from jupyter_client.manager import KernelManager

        km = KernelManager(kernel_name="python3")
        use_launcher(km.kernel_spec)
        # The kernel's input history stays in memory (In, Out, _i and %history of this session work; -l of past ones
        # does not): on disk it is a SQLite write per cell, in a thread that takes the kernel's GIL, ≈ 1–2 ms of every
        # execute. ipykernel 6 also sleeps 0.5 ms after every execute (`_execute_sleep`, "mitigates" lost output in its
        # own words) — more on a busy host; the flushes before it already wait until the output is sent, and the bridge
        # reads the output up to the kernel's idle status, which comes after it on the same socket.
        km.start_kernel(cwd=cwd, extra_arguments=["--HistoryManager.enabled=False", "--IPythonKernel._execute_sleep=0"])
        kc = Channels(km)
        kc.wait_for_ready(timeout=60)
    except Exception as e:  # noqa: BLE001 - any start failure is reported to the agent, then the bridge exits
        emit({"type": "fatal", "error": "%s: %s" % (type(e).__name__, e)})
        flush_frames()
        return 1

    provisioner = getattr(km, "provisioner", None)
    pid = getattr(provisioner, "pid", None) or getattr(getattr(provisioner, "process", None), "pid", None)
    kc.listen()
    emit({"type": "ready", "kernel_pid": pid})
    flush_frames()

    commands = kc.commands
    while True:
        if commands.pending:
            kind, code, envs = commands.pending.popleft()
        elif commands.stopping:
            break
        else:
            kc.next(None)  # until a command arrives (kernel messages in between belong to no execute)
            continue
        if kind == "environ":
            # The machine's envs, given to a kernel started before the machine was handed to its create (a hot pool):
            # kept in its os.environ from now on, as a kernel started after the create has them.
            set_environ(kc, envs)
            continue
        if envs:
            # Variables for this one execute: set in the kernel before it, put back after it.
            set_environ(kc, envs, keep_old=True)
        run(km, kc, code)
        if envs:
            run_silent(kc, "for __kiln_k, __kiln_v in __kiln_saved_env.items():\n    __import__('os').environ.pop(__kiln_k, None) if __kiln_v is None else __import__('os').environ.__setitem__(__kiln_k, __kiln_v)\ndel __kiln_saved_env")

    try:
        kc.close()
        km.shutdown_kernel(now=True)
    except Exception:  # noqa: BLE001 - the agent kills what is left
        pass
    return 0


def use_launcher(spec):
    """
    The kernel runs from python_kernel.py beside this file (ipykernel with its IOPub messages sent without a thread
    hand-over) where the kernel spec would run `python -m ipykernel_launcher`: the same interpreter and arguments. A
    spec of another shape (a template's own kernel) is left as it is.
    """
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_kernel.py")
    argv = list(spec.argv)
    if len(argv) >= 3 and argv[1:3] == ["-m", "ipykernel_launcher"] and os.path.isfile(launcher):
        spec.argv = [argv[0], launcher] + argv[3:]


class Commands:
    """
    The agent's commands, read from stdin whenever the bridge polls: an interrupt reaches the kernel at once (also in
    the middle of an execute), executes wait in `pending`, and a shutdown (or stdin closing: the agent went away)
    stops the bridge once the executes already asked for have run.
    """

    def __init__(self, km):
        self.km = km
        self.fd = sys.stdin.fileno()
        self.buf = b""
        self.pending = collections.deque()
        self.stopping = False
        self.on_stop = None

    def read(self):
        chunk = b"" if self.stopping else os.read(self.fd, 1 << 16)
        if not chunk:
            self.stop()
            return
        lines = (self.buf + chunk).split(b"\n")
        self.buf = lines.pop()
        for line in lines:
            self.handle(line)

    def handle(self, line):
        if self.stopping:
            return
        try:
            cmd = json.loads(line)
        except ValueError:
            return
        if not isinstance(cmd, dict):
            return
        op = cmd.get("op")
        if op == "interrupt":
            try:
                self.km.interrupt_kernel()
            except Exception:  # noqa: BLE001 - a dead kernel is noticed by the execute loop
                pass
        elif op == "execute":
            envs = cmd.get("envs")
            self.pending.append(("execute", cmd.get("code", ""), envs if isinstance(envs, dict) else None))
        elif op == "environ":
            envs = cmd.get("envs")
            if isinstance(envs, dict):
                self.pending.append(("environ", None, envs))
        elif op == "shutdown":
            self.stop()

    def stop(self):
        if not self.stopping:
            self.stopping = True
            if self.on_stop:
                self.on_stop()


class Channels:
    """
    The kernel's shell and iopub sockets, read synchronously with one poller. jupyter_client's blocking client runs an
    asyncio loop for every message it reads (run_sync); an execute reads five, which cost more than the kernel's own
    work. Messages are signed and checked by the manager's Session as the blocking client would.
    """

    def __init__(self, km):
        import zmq

        self.zmq = zmq
        self.session = km.session
        self.shell = km.connect_shell()
        self.iopub = km.connect_iopub()
        self.commands = Commands(km)
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)

    def send(self, msg_type, content):
        msg = self.session.msg(msg_type, content)
        self.session.send(self.shell, msg)
        return msg["header"]["msg_id"]

    def execute(self, code, silent=False, store_history=True):
        content = {"code": code, "silent": silent, "store_history": store_history, "user_expressions": {}, "allow_stdin": False, "stop_on_error": False}
        return self.send("execute_request", content)

    def listen(self):
        """From now on the agent's commands are read (and handled) whenever a socket is polled, or a frame waits."""
        global _commands
        _commands = self.commands
        if not self.commands.stopping:
            self.poller.register(self.commands.fd, self.zmq.POLLIN)
            self.commands.on_stop = lambda: self.poller.unregister(self.commands.fd)

    def next(self, timeout):
        """
        The next message on either socket as (channel, msg), or None when `timeout` seconds (None: no bound) pass with
        none, or a command arrived (the caller looks at it before waiting again).
        """
        wait = None if timeout is None else int(timeout * 1000)
        ready = None
        if _out and (time.monotonic() - _out_since) * 1000 >= HOLD_MS:
            flush_frames()  # messages that keep coming do not hold frames back longer
        if _out:
            ready = dict(self.poller.poll(HOLD_MS if wait is None else min(wait, HOLD_MS)))
            if not ready:
                flush_frames()
        if not ready:
            ready = dict(self.poller.poll(wait))
        if self.commands.fd in ready:
            self.commands.read()
            return None
        for channel, sock in (("iopub", self.iopub), ("shell", self.shell)):
            if sock in ready:
                msg = self.recv(sock)
                if msg is not None:
                    return channel, msg
        return None

    def recv(self, sock):
        """
        One message, its signature checked as Session.deserialize does, without what the bridge never reads:
        Session turns every date in the header and parent header into a datetime with dateutil's parser, about a
        tenth of a millisecond each, four to a message, five messages to an execute.
        """
        try:
            frames = sock.recv_multipart(self.zmq.NOBLOCK)
        except self.zmq.Again:
            return None
        session = self.session
        _, parts = session.feed_identities(frames, copy=True)
        if len(parts) < 5:
            return None
        signature = parts[0]
        if session.auth is not None:
            if not signature or not hmac.compare_digest(signature, session.sign(parts[1:5])) or signature in session.digest_history:
                return None
            session._add_digest(signature)
        header = session.unpack(parts[1])
        return {"header": header, "msg_type": header.get("msg_type"), "parent_header": session.unpack(parts[2]), "content": session.unpack(parts[4])}

    def wait_for_ready(self, timeout):
        """
        Until the kernel answers kernel_info on shell and this iopub subscription sees its status: a subscriber that
        joined late would miss the first execute's output.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg_id = self.send("kernel_info_request", {})
            replied = seen = False
            until = min(deadline, time.monotonic() + 1.0)
            while not (replied and seen) and time.monotonic() < until:
                got = self.next(0.1)
                if got is None:
                    continue
                channel, msg = got
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    replied = replied or channel == "shell"
                    seen = seen or channel == "iopub"
            if replied and seen:
                return
        raise RuntimeError("the kernel did not answer within %d s" % timeout)

    def close(self):
        self.shell.close(linger=0)
        self.iopub.close(linger=0)


def set_environ(kc, envs, keep_old=False):
    """
    Sets `envs` in the kernel's os.environ, silently (no output, no execution count). `keep_old`: what those names
    held before is kept in the kernel, as `__kiln_saved_env` (None: unset), for the bridge to put back.
    """
    code = "__import__('os').environ.update(__import__('json').loads(%r))" % json.dumps(envs)
    if keep_old:
        code = "__kiln_saved_env = {k: __import__('os').environ.get(k) for k in __import__('json').loads(%r)}\n" % json.dumps(sorted(envs)) + code
    run_silent(kc, code)


def run_silent(kc, code):
    msg_id = kc.execute(code, silent=True, store_history=False)
    until = time.monotonic() + 30
    while time.monotonic() < until:
        got = kc.next(0.5)
        if got and got[0] == "shell" and got[1].get("parent_header", {}).get("msg_id") == msg_id:
            return


def run(km, kc, code):
    """
    One execute: the request on shell, then its messages on iopub until the kernel is idle again. Done is emitted
    then, not after the shell reply (it says nothing the iopub messages did not): a reply still on its way is skipped
    by the next execute as a message of another request.
    """
    msg_id = kc.execute(code)
    count = None
    status = "ok"
    while True:
        got = kc.next(0.5)
        if got is None:
            if not km.is_alive():
                emit({"type": "error", "name": "KernelDied", "value": "The kernel process exited during the execution", "traceback": ""})
                emit({"type": "done", "execution_count": count, "status": "died"})
                flush_frames()
                return
            continue
        channel, msg = got
        if channel != "iopub" or msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        content = msg["content"]
        if kind == "stream":
            emit_text("stderr" if content.get("name") == "stderr" else "stdout", content.get("text", ""))
        elif kind in ("execute_result", "display_data", "update_display_data"):
            emit({"type": "result", "data": bundle(content.get("data", {})), "is_main_result": kind == "execute_result", "execution_count": content.get("execution_count")})
        elif kind == "error":
            status = "error"
            tb = "\n".join(_ansi.sub("", line) for line in content.get("traceback", []))
            emit({"type": "error", "name": content.get("ename", "Error"), "value": content.get("evalue", ""), "traceback": tb})
        elif kind == "execute_input":
            count = content.get("execution_count", count)
        elif kind == "status" and content.get("execution_state") == "idle":
            break
    emit({"type": "done", "execution_count": count, "status": status})
    flush_frames()


if __name__ == "__main__":
    sys.exit(main())

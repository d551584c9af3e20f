# The bridge between Kiln's guest agent and one IPython kernel: it starts the kernel with jupyter_client, speaks
# the Jupyter messaging protocol to it, and speaks JSON lines with the agent (commands on stdin, frames on fd 1).
#
# agent -> bridge: {"op": "execute", "code": str} | {"op": "interrupt"} | {"op": "shutdown"}
# bridge -> agent: {"type": "ready", "kernel_pid": int} | {"type": "fatal", "error": str}
#                  {"type": "stdout"|"stderr", "text"} | {"type": "result", "data", "is_main_result", "execution_count"}
#                  {"type": "error", "name", "value", "traceback"} | {"type": "done", "execution_count", "status"}
# Executes run one at a time, in arrival order; an interrupt reaches the kernel at once (SIGINT via the manager).

import json
import os
import queue
import re
import sys
import threading

# Frames go to a private copy of fd 1; fd 1 itself becomes stderr, so nothing the kernel (or a library) prints at
# the file-descriptor level can corrupt the protocol stream.
_proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)
_lock = threading.Lock()
_ansi = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def emit(frame):
    line = json.dumps(frame, ensure_ascii=False)
    with _lock:
        _proto.write(line + "\n")
        _proto.flush()


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
        km.start_kernel(cwd=cwd)
        kc = km.blocking_client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
    except Exception as e:  # noqa: BLE001 - any start failure is reported to the agent, then the bridge exits
        emit({"type": "fatal", "error": "%s: %s" % (type(e).__name__, e)})
        return 1

    provisioner = getattr(km, "provisioner", None)
    pid = getattr(provisioner, "pid", None) or getattr(getattr(provisioner, "process", None), "pid", None)
    work = queue.Queue()

    def read_commands():
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
            except ValueError:
                continue
            op = cmd.get("op")
            if op == "interrupt":
                try:
                    km.interrupt_kernel()
                except Exception:  # noqa: BLE001 - a dead kernel is noticed by the execute loop
                    pass
            elif op == "execute":
                envs = cmd.get("envs")
                work.put((cmd.get("code", ""), envs if isinstance(envs, dict) else None))
            elif op == "shutdown":
                break
        work.put(None)  # stdin closed (the agent went away) or shutdown: stop

    threading.Thread(target=read_commands, daemon=True).start()
    emit({"type": "ready", "kernel_pid": pid})

    while True:
        item = work.get()
        if item is None:
            break
        code, envs = item
        if envs:
            # Variables for this one execute: set in the kernel before it, put back after it (silently: no output,
            # no execution count).
            names = json.dumps(sorted(envs))
            run_silent(kc, "import os as __kiln_os, json as __kiln_json\n__kiln_saved_env = {k: __kiln_os.environ.get(k) for k in __kiln_json.loads(%r)}\n__kiln_os.environ.update(__kiln_json.loads(%r))" % (names, json.dumps(envs)))
        run(km, kc, code)
        if envs:
            run_silent(kc, "for __kiln_k, __kiln_v in __kiln_saved_env.items():\n    __kiln_os.environ.pop(__kiln_k, None) if __kiln_v is None else __kiln_os.environ.__setitem__(__kiln_k, __kiln_v)\ndel __kiln_saved_env")

    try:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    except Exception:  # noqa: BLE001 - the agent kills what is left
        pass
    return 0


def run_silent(kc, code):
    msg_id = kc.execute(code, silent=True, store_history=False, allow_stdin=False)
    try:
        while True:
            reply = kc.get_shell_msg(timeout=30)
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return
    except queue.Empty:
        pass


def run(km, kc, code):
    msg_id = kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
    count = None
    status = "ok"
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            if not km.is_alive():
                emit({"type": "error", "name": "KernelDied", "value": "The kernel process exited during the execution", "traceback": ""})
                emit({"type": "done", "execution_count": count, "status": "died"})
                return
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
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
    # The shell reply follows the idle status; drain it so replies never pile up in the client's queue.
    try:
        while True:
            reply = kc.get_shell_msg(timeout=2)
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                count = reply["content"].get("execution_count", count)
                break
    except queue.Empty:
        pass
    emit({"type": "done", "execution_count": count, "status": status})


if __name__ == "__main__":
    sys.exit(main())

# The IPython kernel as Kiln starts it (python_bridge.py runs this file where jupyter would run `-m ipykernel_launcher`):
# ipykernel itself, with its IOPub messages sent by the thread that made them instead of handed to its IOPub thread.
#
# ipykernel 6 sends every IOPub message (status busy/idle, execute_input, results, output) from a background thread: the
# kernel queues it, wakes that thread through an inproc socket, and the thread (after taking the GIL) sends it. Every
# execute also flushes stdout and stderr, and each flush waits for two such hand-overs to come back. On a 1+1 that is
# about half of the kernel's side of an execute. Here a send happens at once, under a lock (a zmq socket may be used by
# several threads one at a time), and a flush sends what is buffered itself, under the stream's own lock so a flush
# the IOPub thread's timer started finishes before a later message goes out: messages keep the order they were made
# in. The IOPub thread still runs what only it can: the periodic flush of output of a running cell, and output piped
# from forked subprocesses. On an ipykernel whose internals differ the kernel runs unpatched.

import os
import sys
import threading


def _patch():
    try:
        import ipykernel
        import zmq
        from ipykernel import iostream
    except ImportError:
        return
    # ipykernel 7 is built differently (anyio, an XPUB socket its IOPub thread also reads): left as it is.
    if getattr(ipykernel, "version_info", (0,))[0] != 6:
        return
    _patch_control()
    pub, out = getattr(iostream, "IOPubThread", None), getattr(iostream, "OutStream", None)
    if pub is None or out is None or not all(hasattr(pub, a) for a in ("send_multipart", "_really_send")) or not all(hasattr(out, a) for a in ("flush", "_flush")):
        return

    guard = threading.Lock()

    def lock_of(obj, name):
        # One lock per object and process: a child forked while another thread held the lock gets a fresh one.
        pid = os.getpid()
        held = obj.__dict__.get(name)
        if held is None or held[0] != pid:
            with guard:
                held = obj.__dict__.get(name)
                if held is None or held[0] != pid:
                    held = (pid, threading.RLock())
                    obj.__dict__[name] = held
        return held[1]

    init, send_later = pub.__init__, pub.send_multipart

    def __init__(self, socket, *args, **kwargs):
        # Only a PUB socket is never read by the IOPub thread (a later ipykernel's XPUB is): sent to directly.
        self.__dict__["_kiln_direct"] = socket.type == zmq.PUB
        init(self, socket, *args, **kwargs)

    def send_multipart(self, *args, **kwargs):
        if not self.__dict__.get("_kiln_direct"):
            return send_later(self, *args, **kwargs)
        with lock_of(self, "_kiln_send_lock"):
            self._really_send(*args, **kwargs)

    flush_buffer, flush_later = out._flush, out.flush

    def _flush(self):
        with lock_of(self, "_kiln_flush_lock"):
            flush_buffer(self)

    def flush(self):
        if self.pub_thread is None or not self.pub_thread.__dict__.get("_kiln_direct"):
            return flush_later(self)
        self._flush()

    pub.__init__ = __init__
    pub.send_multipart = send_multipart
    out._flush = _flush
    out.flush = flush


def _patch_control():
    """
    Before each shell request ipykernel wakes its control thread to flush the control channel's queue, so a control
    request (a debugger's, an interrupt in "message" mode) sent earlier is handled first. Kiln sends none (it
    interrupts by signal): until the first control message arrives, there is nothing to flush and no thread is woken.
    """
    try:
        from ipykernel.kernelbase import Kernel
    except ImportError:
        return
    if not (hasattr(Kernel, "_flush_control_queue") and hasattr(Kernel, "dispatch_control")):
        return
    flush_queue, dispatch = Kernel._flush_control_queue, Kernel.dispatch_control

    def dispatch_control(self, msg):
        self.__dict__["_kiln_control_used"] = True
        return dispatch(self, msg)

    async def _flush_control_queue(self):
        if self.__dict__.get("_kiln_control_used"):
            return await flush_queue(self)
        return None

    Kernel.dispatch_control = dispatch_control
    Kernel._flush_control_queue = _flush_control_queue


if __name__ == "__main__":
    # sys.path as `python -m ipykernel_launcher` has it: the working directory first, not this file's directory.
    if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
        sys.path[0] = os.getcwd()
    _patch()
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()

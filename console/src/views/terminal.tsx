// A live terminal on a machine: xterm.js over the machine WebSocket's PTY frames (DESIGN.md §5). The browser
// cannot set Authorization on an upgrade, so the key rides in a `kiln.bearer.` subprotocol (auth.ts on the server).
// A dropped socket reconnects to the same session and replays what it missed, from the last offset it saw.

import { useEffect, useRef, useState } from "preact/hooks";
import { Terminal as XTerm } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import { session } from "../api.ts";

const MAX_RECONNECTS = 5;

function toBase64(bytes: Uint8Array): string {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function fromBase64(b64: string): Uint8Array {
  const s = atob(b64);
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

export function machineSocket(machineId: string): WebSocket {
  const url = new URL(`/v1/machines/${encodeURIComponent(machineId)}/ws`, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const key = new TextEncoder().encode(session.key() ?? "");
  const bearer = toBase64(key).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  return new WebSocket(url, ["kiln.v1", `kiln.bearer.${bearer}`]);
}

type Frame = { type: string; session_id?: string; offset?: number; data_base64?: string; exit_code?: number | null; code?: string; error?: string };

export function Terminal({ machineId }: { machineId: string }) {
  const host = useRef<HTMLDivElement>(null);
  const [status, setStatus] = useState("connecting…");
  useEffect(() => {
    const term = new XTerm({ cursorBlink: false, fontSize: 14, scrollback: 5000, fontFamily: "ui-monospace, Menlo, Consolas, monospace" });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(host.current!);
    fit.fit();
    term.focus();
    const encoder = new TextEncoder();
    let ws: WebSocket | undefined;
    let sessionId: string | undefined;
    let nextOffset = 0;
    let reconnects = 0;
    let closed = false;
    let exited = false;

    const send = (frame: object) => {
      if (ws?.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame));
    };
    const connect = () => {
      ws = machineSocket(machineId);
      ws.onopen = () => {
        if (sessionId) send({ type: "pty.reconnect", session_id: sessionId, offset: nextOffset });
        else send({ type: "pty.start", request_id: "console", cols: term.cols, rows: term.rows });
      };
      ws.onmessage = (ev) => {
        const frame = JSON.parse(String(ev.data)) as Frame;
        switch (frame.type) {
          case "pty.started":
            sessionId = frame.session_id;
            reconnects = 0;
            setStatus("connected");
            break;
          case "pty.reconnected":
            reconnects = 0;
            setStatus("connected");
            break;
          case "pty.output": {
            const data = fromBase64(frame.data_base64 ?? "");
            // Replayed output may overlap what was already shown: skip the bytes before nextOffset.
            const skip = Math.max(0, nextOffset - (frame.offset ?? 0));
            if (skip < data.length) term.write(data.subarray(skip));
            nextOffset = Math.max(nextOffset, (frame.offset ?? 0) + data.length);
            break;
          }
          case "pty.exit":
            exited = true;
            setStatus(`exited${frame.exit_code !== null && frame.exit_code !== undefined ? ` (${frame.exit_code})` : ""}`);
            term.write("\r\n[the shell has exited]\r\n");
            break;
          case "error":
            setStatus(`error: ${frame.error ?? frame.code}`);
            break;
        }
      };
      ws.onclose = (ev) => {
        if (closed || exited) return;
        if (!sessionId || ++reconnects > MAX_RECONNECTS || ev.code === 1008) {
          setStatus(ev.code === 1008 ? "closed: the API key was revoked" : `disconnected (${ev.code})`);
          return;
        }
        setStatus("reconnecting…");
        setTimeout(connect, 500 * reconnects);
      };
    };
    connect();

    // Keys typed before the session exists have nowhere to go (the shell's prompt is not there yet either).
    const input = term.onData((data) => sessionId && send({ type: "pty.input", session_id: sessionId, data_base64: toBase64(encoder.encode(data)) }));
    const binary = term.onBinary((data) => sessionId && send({ type: "pty.input", session_id: sessionId, data_base64: btoa(data) }));
    const resize = term.onResize(({ cols, rows }) => sessionId && send({ type: "pty.resize", session_id: sessionId, cols, rows }));
    const observer = new ResizeObserver(() => fit.fit());
    observer.observe(host.current!);
    return () => {
      closed = true;
      observer.disconnect();
      input.dispose();
      binary.dispose();
      resize.dispose();
      // The session stays in the machine (sessions outlive sockets); the console ends it when leaving the page.
      if (sessionId && !exited) send({ type: "pty.kill", session_id: sessionId });
      ws?.close(1000);
      term.dispose();
    };
  }, [machineId]);
  return (
    <div class="terminal-wrap">
      <div class="terminal-status" aria-live="polite">
        Terminal: <span data-terminal-status>{status}</span>
      </div>
      <div class="terminal" ref={host} data-terminal />
    </div>
  );
}

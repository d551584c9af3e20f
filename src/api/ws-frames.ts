// Client frames of the machine WebSocket (DESIGN.md §5), as TypeBox schemas compiled once, plus SPEC.md's
// "exactly one of" rules. A frame that fails here is answered with an `error` frame and never reaches the machine.

import { Type } from "typebox";
import type { TSchema } from "typebox";
import { Compile } from "typebox/compile";
import { Envs, NoNul, UserName } from "./schemas.ts";
import { checkEnvs, INPUT_LIMITS } from "../machines/input-limits.ts";
import { KilnError } from "../errors.ts";
import { parseFrame, schemaRefusal } from "./frame-prologue.ts";

const RequestId = Type.Optional(Type.String({ maxLength: 128 }));
const Pid = Type.Integer({ minimum: 1 });
const SessionId = Type.String({ minLength: 1, maxLength: 128 });
const Signal = Type.String({ pattern: "^(SIG)?[A-Z0-9]+$", maxLength: 16 });
const Cols = Type.Integer({ minimum: 1, maximum: 1000 });
const Rows = Type.Integer({ minimum: 1, maximum: 1000 });
const Cmd = NoNul({ minLength: 1, maxLength: INPUT_LIMITS.cmdChars });
const Args = Type.Array(NoNul({ maxLength: INPUT_LIMITS.argChars }), { maxItems: INPUT_LIMITS.args });
const Path = NoNul({ minLength: 1, maxLength: INPUT_LIMITS.pathChars });
const User = UserName;
const Base64 = Type.String({ pattern: "^[A-Za-z0-9+/]*={0,2}$" });

function frame<P extends Record<string, TSchema>>(type: string, props: P) {
  return Type.Object({ type: Type.Literal(type), ...props }, { additionalProperties: false });
}

export const CLIENT_FRAMES = {
  "exec.start": frame("exec.start", { request_id: RequestId, cmd: Cmd, args: Type.Optional(Args), cwd: Type.Optional(Path), envs: Type.Optional(Envs), user: Type.Optional(User), stdin: Type.Optional(Type.Boolean()) }),
  "exec.stdin": frame("exec.stdin", { request_id: RequestId, pid: Pid, data: Type.Optional(Type.String()), data_base64: Type.Optional(Base64), eof: Type.Optional(Type.Boolean()) }),
  "exec.signal": frame("exec.signal", { request_id: RequestId, pid: Pid, signal: Signal }),
  "pty.start": frame("pty.start", { request_id: RequestId, cmd: Type.Optional(Cmd), args: Type.Optional(Args), cwd: Type.Optional(Path), envs: Type.Optional(Envs), user: Type.Optional(User), cols: Cols, rows: Rows }),
  "pty.input": frame("pty.input", { request_id: RequestId, session_id: Type.Optional(SessionId), pid: Type.Optional(Pid), data: Type.Optional(Type.String()), data_base64: Type.Optional(Base64) }),
  "pty.resize": frame("pty.resize", { request_id: RequestId, session_id: Type.Optional(SessionId), pid: Type.Optional(Pid), cols: Cols, rows: Rows }),
  "pty.reconnect": frame("pty.reconnect", { request_id: RequestId, session_id: Type.Optional(SessionId), pid: Type.Optional(Pid), offset: Type.Optional(Type.Integer({ minimum: 0 })) }),
  "pty.kill": frame("pty.kill", { request_id: RequestId, session_id: Type.Optional(SessionId), pid: Type.Optional(Pid), signal: Type.Optional(Signal) }),
  file_watch: frame("file_watch", { request_id: RequestId, path: Path, recursive: Type.Optional(Type.Boolean()) }),
  file_unwatch: frame("file_unwatch", { request_id: RequestId, watch_id: Type.String({ minLength: 1, maxLength: 64 }) }),
} as const;

export type ClientFrameType = keyof typeof CLIENT_FRAMES;

const validators = Object.fromEntries(Object.entries(CLIENT_FRAMES).map(([k, schema]) => [k, Compile(schema)])) as Record<ClientFrameType, ReturnType<typeof Compile>>;

/** Pairs of which a frame must carry exactly one (SPEC.md: PTY reconnect and PTY input; the same for resize/kill targets). */
const EXACTLY_ONE: Partial<Record<ClientFrameType, [string, string][]>> = {
  "pty.input": [["session_id", "pid"], ["data_base64", "data"]],
  "pty.resize": [["session_id", "pid"]],
  "pty.reconnect": [["session_id", "pid"]],
  "pty.kill": [["session_id", "pid"]],
};

export type FrameCheck = { ok: true; frame: Record<string, unknown> & { type: ClientFrameType } } | { ok: false; error: string; request_id?: string };

export function checkClientFrame(text: string): FrameCheck {
  const parsed = parseFrame(text, Object.keys(CLIENT_FRAMES) as ClientFrameType[], `one of ${Object.keys(CLIENT_FRAMES).join(", ")}`);
  if (!parsed.ok) return parsed;
  const { obj, request_id: requestId } = parsed;
  const t = parsed.type;
  for (const [a, b] of EXACTLY_ONE[t] ?? []) {
    const has = [obj[a] !== undefined, obj[b] !== undefined];
    if (has[0] === has[1]) return { ok: false, error: `${t} takes exactly one of ${a} or ${b}`, request_id: requestId };
  }
  if (t === "exec.stdin" && obj.data !== undefined && obj.data_base64 !== undefined) {
    return { ok: false, error: "exec.stdin takes at most one of data_base64 or data", request_id: requestId };
  }
  const refused = schemaRefusal(t, validators[t], obj, requestId);
  if (refused) return refused;
  try {
    checkEnvs(obj.envs as Record<string, string> | undefined, `${t} envs`);
  } catch (err) {
    if (err instanceof KilnError) return { ok: false, error: err.message, request_id: requestId };
    throw err;
  }
  return { ok: true, frame: obj as Record<string, unknown> & { type: ClientFrameType } };
}

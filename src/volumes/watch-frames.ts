// Frames of the volume watch WebSocket (DESIGN.md §5) and which events a watch receives. Client frames are checked
// here; anything that fails is answered with an `error` frame and changes nothing.

import { Type } from "typebox";
import { Compile } from "typebox/compile";
import { posix } from "node:path";
import { parseFrame, schemaRefusal } from "../api/frame-prologue.ts";

const RequestId = Type.Optional(Type.String({ maxLength: 128 }));
const WatchId = Type.String({ minLength: 1, maxLength: 64 });

export const VOLUME_CLIENT_FRAMES = {
  file_watch: Type.Object(
    { type: Type.Literal("file_watch"), request_id: RequestId, path: Type.String({ minLength: 1, maxLength: 4096 }), recursive: Type.Optional(Type.Boolean()) },
    { additionalProperties: false },
  ),
  file_unwatch: Type.Object({ type: Type.Literal("file_unwatch"), request_id: RequestId, watch_id: WatchId }, { additionalProperties: false }),
} as const;

export type WatchFrame = { type: "file_watch"; request_id?: string; path: string; recursive?: boolean } | { type: "file_unwatch"; request_id?: string; watch_id: string };

const validators = { file_watch: Compile(VOLUME_CLIENT_FRAMES.file_watch), file_unwatch: Compile(VOLUME_CLIENT_FRAMES.file_unwatch) };

export type WatchFrameCheck = { ok: true; frame: WatchFrame } | { ok: false; error: string; request_id?: string };

export function checkWatchFrame(text: string): WatchFrameCheck {
  const parsed = parseFrame(text, ["file_watch", "file_unwatch"] as const, "file_watch or file_unwatch");
  if (!parsed.ok) return parsed;
  const { obj, request_id } = parsed;
  if (obj.type === "file_watch") {
    // SPEC.md: user-scoped file watches are not supported on volume sockets.
    if ("user" in obj) return { ok: false, error: "User-scoped file watches are not supported on volume sockets; watch a volume path rooted at /", request_id };
    if (typeof obj.path === "string" && !obj.path.startsWith("/")) {
      return { ok: false, error: `Volume watch paths are rooted at /: ${JSON.stringify(obj.path)} is relative`, request_id };
    }
    if (typeof obj.path === "string" && obj.path.includes("\0")) return { ok: false, error: "path contains a NUL byte", request_id };
  }
  const refused = schemaRefusal(parsed.type, validators[parsed.type], obj, request_id);
  if (refused) return refused;
  return { ok: true, frame: obj as WatchFrame };
}

/** Whether an event at `path` belongs to a watch of `watched`: itself, a direct child, or (recursive) anything below. */
export function watchCovers(watched: string, recursive: boolean, path: string): boolean {
  if (path === watched) return true;
  const prefix = watched === "/" ? "/" : watched + "/";
  if (!path.startsWith(prefix)) return false;
  return recursive || posix.dirname(path) === watched;
}

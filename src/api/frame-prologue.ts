// The one prologue of every WebSocket's client frames (the machine socket and the volume watch socket): a JSON
// object with a known `type`, then its TypeBox schema. What fails becomes the text of an `error` frame.

/** A frame refused: the error frame's text, and the request_id it carried (if it carried one). */
export type FrameRefusal = { ok: false; error: string; request_id?: string };

/** A frame that is a JSON object of a known type (its fields are checked by the caller's schema next). */
export type ParsedFrame<T extends string> = { ok: true; obj: Record<string, unknown>; type: T; request_id?: string };

/** Parses `text` as a client frame whose `type` is one of `types`; `expected` names them in the refusal. */
export function parseFrame<T extends string>(text: string, types: readonly T[], expected: string): ParsedFrame<T> | FrameRefusal {
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch {
    return { ok: false, error: "A frame must be a JSON object" };
  }
  if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) return { ok: false, error: "A frame must be a JSON object" };
  const obj = parsed as Record<string, unknown>;
  const request_id = typeof obj.request_id === "string" ? obj.request_id : undefined;
  const type = obj.type;
  if (typeof type !== "string" || !(types as readonly string[]).includes(type)) {
    return { ok: false, error: `Unknown frame type ${JSON.stringify(type)}; expected ${expected}`, request_id };
  }
  return { ok: true, obj, type: type as T, request_id };
}

/** The refusal for a frame its compiled schema rejects (the first error, at its field's dotted path); undefined if valid. */
export function schemaRefusal(type: string, validator: { Check(v: unknown): boolean; Errors(v: unknown): Iterable<unknown> }, obj: unknown, request_id: string | undefined): FrameRefusal | undefined {
  if (validator.Check(obj)) return undefined;
  const first = [...validator.Errors(obj)][0] as { instancePath?: string; message?: string } | undefined;
  const where = first?.instancePath ? first.instancePath.replace(/^\//, "").replaceAll("/", ".") : "frame";
  return { ok: false, error: `Invalid ${type}: ${where} ${first?.message ?? "is not valid"}`, request_id };
}

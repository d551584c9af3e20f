// Bounds on what a key holder may send: sizes of envs, metadata, names and paths, and the rule that no string
// reaching a path, argv, env or cwd carries a NUL byte. Schemas take their numbers from here; the totals a schema
// cannot express are checked by checkEnvs/checkMetadata, for REST and WebSocket alike.

import { KilnError } from "../errors.ts";

export const INPUT_LIMITS = {
  /** Machine names, template refs. */
  nameChars: 128,
  pathChars: 4096,
  envKeys: 256,
  envNameChars: 256,
  envValueChars: 32 * 1024,
  envTotalBytes: 256 * 1024,
  metadataKeys: 64,
  metadataKeyChars: 64,
  metadataValueChars: 4096,
  metadataTotalBytes: 16 * 1024,
  cmdChars: 131_072,
  argChars: 131_072,
  args: 4096,
} as const;

/** A string without NUL: the kernel ends C strings there, so a NUL in a path, argv or env is never meant. */
export const NO_NUL = "^[^\\u0000]*$";
/** POSIX portable environment variable names. */
export const ENV_NAME = "^[A-Za-z_][A-Za-z0-9_]*$";

/** Serialized size of a string map as stored and sent (JSON). */
function serializedBytes(map: Record<string, string>): number {
  return Buffer.byteLength(JSON.stringify(map));
}

export function checkEnvs(envs: Record<string, string> | undefined, field = "envs"): void {
  if (!envs) return;
  for (const [k, v] of Object.entries(envs)) {
    if (!new RegExp(ENV_NAME).test(k)) throw new KilnError("invalid_request", `${field}: ${JSON.stringify(k.slice(0, 64))} is not a valid environment variable name (letters, digits, _; not starting with a digit)`);
    if (typeof v !== "string" || v.includes("\0")) throw new KilnError("invalid_request", `${field}.${k} must be a string without NUL bytes`);
  }
  if (serializedBytes(envs) > INPUT_LIMITS.envTotalBytes) throw new KilnError("invalid_request", `${field} are larger than ${INPUT_LIMITS.envTotalBytes} bytes in total`);
}

export function checkMetadata(metadata: Record<string, string> | undefined): void {
  if (!metadata) return;
  if (serializedBytes(metadata) > INPUT_LIMITS.metadataTotalBytes) throw new KilnError("invalid_request", `metadata is larger than ${INPUT_LIMITS.metadataTotalBytes} bytes serialized`);
}

// Kiln's identifiers: "<prefix>_" + 26 Crockford base32 characters, ULID-like (48-bit ms time + 80 random bits),
// monotonic within a millisecond in one process, so ordering by id is creation order (cursor pagination relies on it).

import { randomBytes } from "node:crypto";

export const ID_PREFIXES = ["mch", "tpl", "art", "bld", "key", "evt", "req", "vol", "dep", "ver", "svc", "whk", "dlv", "ctx"] as const;
export type IdPrefix = (typeof ID_PREFIXES)[number];

const ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz";
let lastTime = -1;
let lastRandom: bigint = 0n;

export function newId(prefix: IdPrefix): string {
  const now = Date.now();
  let rand: bigint;
  if (now <= lastTime) {
    // Same (or earlier, if the clock stepped back) millisecond: bump the random part so ids stay increasing.
    rand = (lastRandom + 1n) & ((1n << 80n) - 1n);
  } else {
    rand = BigInt("0x" + randomBytes(10).toString("hex"));
    lastTime = now;
  }
  lastRandom = rand;
  let value = (BigInt(Math.max(now, lastTime)) << 80n) | rand;
  let out = "";
  for (let i = 0; i < 26; i++) {
    out = ALPHABET[Number(value & 31n)] + out;
    value >>= 5n;
  }
  return `${prefix}_${out}`;
}

// Kiln's identifiers: "<prefix>_" + 26 Crockford base32 characters, ULID-like (10 characters of millisecond time,
// 16 of randomness), monotonic within a millisecond in one process, so sorting ids sorts by creation.

import { randomFillSync } from "node:crypto";

export const ID_PREFIXES = ["mch", "tpl", "art", "bld", "key", "evt", "req", "vol", "dep", "ver", "svc", "whk", "dlv", "ctx", "snp"] as const;
export type IdPrefix = (typeof ID_PREFIXES)[number];

const ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz";
const pool = Buffer.alloc(16 * 256);
let poolAt = pool.length;
let lastTime = -1;
const lastRandom = new Uint8Array(16);

function freshRandom(into: Uint8Array) {
  if (poolAt + 16 > pool.length) {
    randomFillSync(pool);
    poolAt = 0;
  }
  for (let i = 0; i < 16; i++) into[i] = pool[poolAt + i] & 31;
  poolAt += 16;
}

/**
 * Adds one to the 80-bit random part (base 32 digits), so ids made in the same millisecond still increase.
 * Returns false on overflow (2^80 ids in one millisecond: only in theory), and the caller moves to the next ms.
 */
function increment(digits: Uint8Array): boolean {
  for (let i = digits.length - 1; i >= 0; i--) {
    if (digits[i] < 31) {
      digits[i]++;
      return true;
    }
    digits[i] = 0;
  }
  return false;
}

/** `"<prefix>_"` + 26 characters; sorting ids of one prefix sorts them by creation. */
export function newId(prefix: IdPrefix): string {
  let now = Date.now();
  if (now <= lastTime) {
    // Same millisecond, or the clock stepped back: stay on the last time and count up, so ids never go backwards.
    if (increment(lastRandom)) now = lastTime;
    else {
      now = ++lastTime;
      freshRandom(lastRandom);
    }
  } else {
    lastTime = now;
    freshRandom(lastRandom);
  }
  let time = "";
  for (let i = 0; i < 10; i++) {
    time = ALPHABET[now % 32] + time;
    now = Math.floor(now / 32);
  }
  let rand = "";
  for (let i = 0; i < 16; i++) rand += ALPHABET[lastRandom[i]];
  return `${prefix}_${time}${rand}`;
}

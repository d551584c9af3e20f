// What a running machine needs on the host besides its own processes, checked every few seconds and at start by
// the driver's heal(): its network helper alive (a dead slirp4netns is started again into the same namespace, in
// the same egress cgroup — see network.ts), and the host files its processes write kept under a cap.
//
// Host files a machine writes: runtime.log (the runtime's and the machine's first processes' stdout and stderr)
// lives on the machine's own disk image, so it never grows past the disk_mb the machine was given, and is trimmed
// here to its last HOST_LOG_KEEP_BYTES once it passes HOST_LOG_MAX_BYTES; slirp.log (slirp4netns's own messages)
// is trimmed the same way.

import { open, stat } from "node:fs/promises";

/** A host log file past this size is trimmed at the next health check. */
export const HOST_LOG_MAX_BYTES = 1024 * 1024;
/** What a trimmed log keeps: its last bytes, after a line saying how much went. */
export const HOST_LOG_KEEP_BYTES = 64 * 1024;

/**
 * Trims `file` to its last HOST_LOG_KEEP_BYTES when it is larger than HOST_LOG_MAX_BYTES; true when it did. Its
 * writers append (O_APPEND), so they carry on at the new end.
 */
export async function trimLog(file: string): Promise<boolean> {
  const st = await stat(file).catch(() => undefined);
  if (!st || st.size <= HOST_LOG_MAX_BYTES) return false;
  const fh = await open(file, "r+");
  try {
    const tail = Buffer.alloc(HOST_LOG_KEEP_BYTES);
    const { bytesRead } = await fh.read(tail, 0, HOST_LOG_KEEP_BYTES, Math.max(0, st.size - HOST_LOG_KEEP_BYTES));
    await fh.truncate(0);
    const note = Buffer.from(`[kiln: ${st.size - bytesRead} earlier bytes of this log were dropped (cap ${HOST_LOG_MAX_BYTES} bytes)]\n`);
    // Appended, not written at offset 0: whatever a writer appended since the truncate stays.
    const append = await open(file, "a");
    try {
      await append.write(Buffer.concat([note, tail.subarray(0, bytesRead)]));
    } finally {
      await append.close();
    }
  } finally {
    await fh.close();
  }
  return true;
}

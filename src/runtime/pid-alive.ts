// Whether a process id names a live process (ours or another user's): the one check behind every stale-claim,
// stale-temp-dir and dead-machine sweep on the host.

export function pidAlive(pid: number): boolean {
  if (pid === process.pid) return true;
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

// The first thing the agent does, before any other module runs: make its own process not dumpable, so nothing
// in the machine — machine root included — can ptrace it, take its file descriptors with pidfd_getfd (its
// listening socket, its stdout), or read its memory, environment or fds through /proc.
//
// Node has no prctl(PR_SET_DUMPABLE). The kernel also clears dumpability whenever a process changes its effective
// uid (kernel/cred.c commit_creds; gVisor's task_identity.go does the same), and keeps it cleared until the next
// execve: so the agent steps to another uid and back. Its real and saved uids stay 0 throughout, so the step back
// restores its effective capabilities. Ptrace-style access to a non-dumpable process needs CAP_SYS_PTRACE in its
// user namespace, which no machine process has (it is outside the spec's bounding set). Processes the agent
// starts are dumpable again after their own execve, as usual.
//
// Under runc the agent is already non-dumpable (it starts from an exec-only loader: runtime/guest-runtime.ts);
// this step is what protects it under gVisor, and a second lock under runc.

/** Any uid of the machine's user namespace other than 0: held for two syscalls, never for running code. */
const STEP_UID = 65534;

const { geteuid, seteuid } = process;
if (geteuid && seteuid && geteuid() === 0) {
  try {
    seteuid(STEP_UID);
  } finally {
    seteuid(0);
  }
}

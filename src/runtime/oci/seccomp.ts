// The default seccomp profile of every machine: allow by default, refuse (EPERM) the syscalls that reach past a
// container — kernel modules, kexec, clocks, swap, keyrings, BPF, perf, raw handles — as Docker's default does.

const DENIED = [
  "acct",
  "add_key",
  "bpf",
  "clock_adjtime",
  "clock_settime",
  "create_module",
  "delete_module",
  "finit_module",
  "get_kernel_syms",
  "get_mempolicy",
  "init_module",
  "ioperm",
  "iopl",
  "kcmp",
  "kexec_file_load",
  "kexec_load",
  "keyctl",
  "lookup_dcookie",
  "mbind",
  "move_pages",
  "name_to_handle_at",
  "nfsservctl",
  "open_by_handle_at",
  "perf_event_open",
  "query_module",
  "quotactl",
  "request_key",
  "set_mempolicy",
  "settimeofday",
  "stime",
  "swapoff",
  "swapon",
  "_sysctl",
  "sysfs",
  "uselib",
  "userfaultfd",
  "ustat",
  "vm86",
  "vm86old",
  "adjtimex",
  "reboot",
];

export function defaultSeccomp() {
  return {
    defaultAction: "SCMP_ACT_ALLOW",
    architectures: ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64"],
    syscalls: [{ names: DENIED, action: "SCMP_ACT_ERRNO", errnoRet: 1 }],
  };
}

// The default seccomp profile of every machine (under runsc, applied inside the sandbox): allow by default, refuse
// what reaches past a container — kernel modules, kexec, clocks, swap, keyrings, BPF, perf, io_uring, raw handles,
// new namespaces — as Docker's does.

/** Refused with EPERM: each needs a capability machines never hold, or exposes host kernel state or attack surface. */
const DENIED = [
  "acct",
  "add_key",
  "adjtimex",
  "bpf",
  "clock_adjtime",
  "clock_settime",
  "create_module",
  "delete_module",
  "finit_module",
  "fsconfig",
  "fsmount",
  "fsopen",
  "fspick",
  "get_kernel_syms",
  "get_mempolicy",
  "init_module",
  "io_uring_enter",
  "io_uring_register",
  "io_uring_setup",
  "ioperm",
  "iopl",
  "kcmp",
  "kexec_file_load",
  "kexec_load",
  "keyctl",
  "lookup_dcookie",
  "mbind",
  "mount",
  "mount_setattr",
  "move_mount",
  "move_pages",
  "name_to_handle_at",
  "nfsservctl",
  "open_by_handle_at",
  "open_tree",
  "perf_event_open",
  "pivot_root",
  "quotactl",
  "quotactl_fd",
  "query_module",
  "reboot",
  "request_key",
  "set_mempolicy",
  "setns",
  "settimeofday",
  "stime",
  "swapoff",
  "swapon",
  "_sysctl",
  "sysfs",
  "syslog",
  "umount",
  "umount2",
  "unshare",
  "uselib",
  "userfaultfd",
  "ustat",
  "vm86",
  "vm86old",
];

/** CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: a nested namespace is a door to more kernel. */
const CLONE_NAMESPACE_FLAGS = [0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000];

const EPERM = 1;
const ENOSYS = 38;

/**
 * gVisor applies the profile inside its own kernel (--oci-seccomp) but answers every SCMP_ACT_ERRNO with EPERM;
 * SCMP_ACT_TRACE with no tracer attached answers ENOSYS there, as Linux does, so clone3 uses that.
 */
export function defaultSeccomp(runtime: "runc" | "runsc" = "runc") {
  return {
    defaultAction: "SCMP_ACT_ALLOW",
    architectures: ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
    syscalls: [
      { names: DENIED, action: "SCMP_ACT_ERRNO", errnoRet: EPERM },
      // clone's flags are its first argument on x86 and arm; one rule per flag because seccomp can only AND-compare.
      ...CLONE_NAMESPACE_FLAGS.map((flag) => ({
        names: ["clone"],
        action: "SCMP_ACT_ERRNO",
        errnoRet: EPERM,
        args: [{ index: 0, value: flag, valueTwo: flag, op: "SCMP_CMP_MASKED_EQ" }],
      })),
      // clone3 passes its flags in memory seccomp cannot read: ENOSYS makes glibc and others fall back to clone.
      runtime === "runc" ? { names: ["clone3"], action: "SCMP_ACT_ERRNO", errnoRet: ENOSYS } : { names: ["clone3"], action: "SCMP_ACT_TRACE" },
    ],
  };
}

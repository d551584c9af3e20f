// kiln-idmount: the mount and namespace calls runc 1.1 and util-linux 2.38 cannot make, for one machine boot.
// Built from this file by src/runtime/oci/idmount.ts (gcc, at first use) and run by the oci driver in front of the
// runtime's own command line, so a boot costs one exec more than the runtime alone, not one per mount.
//
//   kiln-idmount probe DIR...
//       exits 0 when every DIR's filesystem can be seen through an idmapped mount (kernel >= 5.19 and fs support).
//
//   kiln-idmount freeze-clone MOUNTPOINT SRC DEST
//       freezes the filesystem at MOUNTPOINT (flushing it into its image), reflinks SRC to a new DEST (FICLONE),
//       thaws it: a machine disk's consistent copy in one process (DEST is removed when the copy fails).
//
//   kiln-idmount boot [OPTIONS] [-- COMMAND ARGS...]
//     --userns FILE --owner UID --map HOSTBASE [--sysctl NAME=VALUE]... [--rlimit NAME=VALUE]...
//         makes the machine's user namespace, owned by host uid OWNER — so the kernel charges every per-user counter
//         of the machine (inotify instances and watches, message queue bytes, pending signals, locked memory) to
//         OWNER instead of host root — mapping machine ids 0..65535 to HOSTBASE..; the namespace takes its caps on
//         those counters from the --rlimit values and /proc/sys/user/NAME inside it is set to VALUE. FILE is a symlink
//         to it (/proc/<pid>/ns/user of its first process, which lives until COMMAND — the runtime, which joins it by
//         path — has exited, then FILE goes).
//     --idmap CANONICAL:HOSTBASE:COUNT
//         sees the template layers (read-only), the machine's disk and each --bind source — whose files are stored
//         with ids CANONICAL.. — through idmapped mounts as HOSTBASE.. (host root stays host root: overlayfs makes
//         its work files as the mounter).
//     --scratch DIR --lower DIR... --disk DIR --rootfs DIR
//         mounts overlayfs on ROOTFS: the layers (lowest first) under DISK/upper, work dir DISK/work. Idmapped layer
//         and disk mounts are attached under SCRATCH only while overlayfs takes them (it keeps private copies).
//     --bind SRC DST | --bind-ro SRC DST
//         an idmapped copy of mount SRC attached at DST, for the runtime to bind into the machine (needs --idmap).
//     --upper NAME --work NAME
//         the overlay's upper and work dirs are DISK/NAME (default upper and work): a build machine's next step gets a
//         new, empty pair on the same disk (names of letters, digits, '-' and '.').
//     --swap-into PID [--image FILE [--clone-from SRC]]
//         without --image (a build machine's next step): only the host's mount of ROOTFS is detached (its root still
//         holds it), the disk stays as it is, and the new overlay over it becomes the root as below.
//         With --rootfs and no COMMAND, ROOTFS and DISK being the running machine's: first its host mounts of ROOTFS
//         and DISK are detached (its root still holds them), its disk image FILE is unlinked (its loop device holds it
//         until the old root goes) and FILE.taking (made here as a reflink of SRC with --clone-from) takes its name and
//         is loop-mounted on DISK (ext4, as the driver mounts disks); then the overlay is mounted and becomes the root
//         of the running machine whose first
//         process is PID (runc). In PID's mount namespace it is attached, every mount directly on the old root (with
//         what is mounted below it: /proc, /dev, /sys, /opt/kiln, /etc files, ...) is cloned to the same place under
//         it, then pivot_root(2) moves the root and cwd of every process whose root or cwd was the old root (tini and
//         the agent) onto it, and the old root is detached lazily (it goes once nothing holds a file of it).
//     --nofile SOFT:HARD
//         the open-file limit COMMAND (and so the machine) starts with.
//     -- COMMAND ARGS...
//         run with this process's stdio and every inherited fd; once it exits, the --bind mounts are detached and
//         FILE removed (the machine holds its own copies and namespace by then), and its exit status is ours.
//
// Every failure prints one line `kiln-idmount: <what> <path>: <reason>` on stderr and exits 1 (2: bad usage).

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fs.h>
#include <linux/loop.h>
#include <linux/openat2.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_ITEMS 512
#define MAX_SYSCTLS 16
#define MACHINE_IDS 65536

static void die(const char *what, const char *path) {
  fprintf(stderr, "kiln-idmount: %s %s: %s\n", what, path ? path : "", strerror(errno));
  exit(1);
}

static void usage(const char *why) {
  fprintf(stderr, "kiln-idmount: %s\n", why);
  exit(2);
}

static void write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) die("open", path);
  ssize_t n = write(fd, text, strlen(text));
  if (n != (ssize_t)strlen(text)) die("write", path);
  close(fd);
}

static unsigned long parse_num(const char *s) {
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno || *s == '\0' || *end != '\0') usage("a number was expected");
  return v;
}

struct userns_request {
  uid_t owner;            // host uid the namespace belongs to (0: the namespace is only an idmap)
  const char *map;        // written to /proc/<pid>/uid_map and gid_map
  const char *sysctl[MAX_SYSCTLS];
  int sysctls;
  int rlimit_res[8];
  rlim_t rlimit_val[8];
  int rlimits;
  const char *link;       // symlink to the namespace here, its first process kept alive until release_userns
  int want_fd;            // return an fd of the namespace
  pid_t pid;              // the namespace's first process
  int release_fd;         // closing it lets that process go
  int from_child;
};

static void read_byte(int fd) {
  char c;
  if (read(fd, &c, 1) != 1) _exit(3);
}

/**
 * A user namespace made by a child that first becomes `owner` (the namespace belongs to the uid that makes it),
 * mapped by us from outside (host root may map any ids) and limited from inside. The child then waits on a pipe:
 * for an opened namespace it is let go at once; for a linked one, when we close `release_fd` (or die).
 * The namespace's caps on its owner's counters are the child's rlimits at unshare. Two namespaces are made side by
 * side (start both, then finish both), so a busy host's scheduling delays overlap.
 */
static void start_userns(struct userns_request *r) {
  int to_parent[2], to_child[2];
  pid_t parent = getpid();
  if (pipe2(to_parent, O_CLOEXEC) || pipe2(to_child, O_CLOEXEC)) die("pipe", NULL);
  pid_t pid = fork();
  if (pid < 0) die("fork", NULL);
  if (pid == 0) {
    // Only the parent may hold the write end: its exit must reach us as end-of-file. Nothing else is ours either
    // (another namespace's pipes, the runtime's inherited fds).
    int lo = to_parent[1] < to_child[0] ? to_parent[1] : to_child[0];
    int hi = to_parent[1] < to_child[0] ? to_child[0] : to_parent[1];
    if (lo > 3) close_range(3, lo - 1, 0);
    if (hi > lo + 1) close_range(lo + 1, hi - 1, 0);
    close_range(hi + 1, ~0U, 0);
    for (int i = 0; i < r->rlimits; i++) {
      struct rlimit l = {r->rlimit_val[i], r->rlimit_val[i]};
      if (setrlimit(r->rlimit_res[i], &l)) die("setrlimit", NULL);
    }
    if (r->owner != 0 && (setgroups(0, NULL) || setresgid(r->owner, r->owner, r->owner) || setresuid(r->owner, r->owner, r->owner))) die("become", "the namespace's owner");
    // Set after the uid change, which clears it.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(3);
    if (unshare(CLONE_NEWUSER)) die("unshare", "user namespace");
    if (write(to_parent[1], "u", 1) != 1) _exit(3);
    read_byte(to_child[0]);  // mapped
    for (int i = 0; i < r->sysctls; i++) {
      char path[128], value[32];
      const char *eq = strchr(r->sysctl[i], '=');
      snprintf(path, sizeof path, "/proc/sys/user/%.*s", (int)(eq - r->sysctl[i]), r->sysctl[i]);
      snprintf(value, sizeof value, "%s\n", eq + 1);
      write_file(path, value);
    }
    if (write(to_parent[1], "s", 1) != 1) _exit(3);
    char c;
    while (read(to_child[0], &c, 1) > 0) {
    }  // until released
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  r->pid = pid;
  r->from_child = to_parent[0];
  r->release_fd = to_child[1];
}

static int finish_userns(struct userns_request *r) {
  pid_t pid = r->pid;
  char c, path[64];
  if (read(r->from_child, &c, 1) != 1) usage("the user namespace could not be made");
  snprintf(path, sizeof path, "/proc/%d/uid_map", pid);
  write_file(path, r->map);
  snprintf(path, sizeof path, "/proc/%d/gid_map", pid);
  write_file(path, r->map);
  if (write(r->release_fd, "m", 1) != 1) die("write", "to the namespace's first process");
  if (read(r->from_child, &c, 1) != 1) usage("the limits of the user namespace could not be set");
  snprintf(path, sizeof path, "/proc/%d/ns/user", pid);
  close(r->from_child);
  int fd = -1;
  if (r->want_fd && (fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) die("open", path);
  if (r->link) {
    // Written aside and renamed over FILE, so a leftover of a killed boot is replaced, never followed.
    char temp[4096];
    snprintf(temp, sizeof temp, "%s.%d", r->link, getpid());
    unlink(temp);
    if (symlink(path, temp) || rename(temp, r->link)) die("link", r->link);
    return fd;
  }
  // Opened: the child may go (it is reaped when we exit; nothing waits for it).
  close(r->release_fd);
  return fd;
}

static void release_userns(struct userns_request *r) {
  unlink(r->link);
  close(r->release_fd);
  waitpid(r->pid, NULL, 0);
}

/** A clone of mount `src` (only it, not what is mounted below) seen through `userns_fd`'s ids, attached at `dst`. */
static int clone_idmapped(const char *src, int userns_fd, int readonly) {
  int fd = open_tree(AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
  if (fd < 0) die("open_tree", src);
  struct mount_attr attr = {0};
  attr.attr_set = MOUNT_ATTR_IDMAP | (readonly ? MOUNT_ATTR_RDONLY : 0);
  attr.userns_fd = userns_fd;
  if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof attr)) die("mount_setattr", src);
  return fd;
}

static void attach_idmapped(const char *src, const char *dst, int userns_fd, int readonly) {
  int fd = clone_idmapped(src, userns_fd, readonly);
  if (mkdir(dst, 0700) && errno != EEXIST) die("mkdir", dst);
  if (move_mount(fd, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH)) die("move_mount", dst);
  close(fd);
}

static void detach(const char *path, int is_dir) {
  if (umount2(path, MNT_DETACH) && errno != EINVAL && errno != ENOENT) die("umount", path);
  if (is_dir) rmdir(path);
  else unlink(path);
}

static int probe(int n, char **dirs) {
  struct userns_request r = {0};
  r.map = "0 1000000000 1\n";
  r.want_fd = 1;
  start_userns(&r);
  int ns = finish_userns(&r);
  for (int i = 0; i < n; i++) close(clone_idmapped(dirs[i], ns, 0));
  return 0;
}

static const struct {
  const char *name;
  int resource;
} RLIMITS[] = {{"msgqueue", RLIMIT_MSGQUEUE}, {"sigpending", RLIMIT_SIGPENDING}, {"memlock", RLIMIT_MEMLOCK}, {"nproc", RLIMIT_NPROC}};

#define MAX_MOUNTS 256

/** Mount points (machine paths) of the mounts directly on the root of PID's mount namespace, in mount order. */
static int top_mounts(const char *pid, char **points, int max) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%s/mountinfo", pid);
  FILE *f = fopen(path, "re");
  if (!f) die("open", path);
  char line[8192];
  long root_id = -1;
  int n = 0;
  while (fgets(line, sizeof line, f)) {
    long id, parent;
    char point[4096];
    if (sscanf(line, "%ld %ld %*s %*s %4095s", &id, &parent, point) != 3) usage("unreadable mountinfo");
    if (root_id < 0) {
      if (strcmp(point, "/") == 0) root_id = id;
      continue;
    }
    if (parent != root_id) continue;
    if (strchr(point, '\\')) usage("a machine mount point with an escaped character");
    if (n == max) usage("too many mounts in the machine");
    points[n++] = strdup(point);
  }
  fclose(f);
  if (root_id < 0) usage("the machine has no root mount");
  return n;
}

/** `path` opened below `root` as if `root` were / (symlinks and .. stay inside it; no /proc magic links). */
static int open_in_root(int root, const char *path, int flags) {
  struct open_how how;
  memset(&how, 0, sizeof how);
  how.flags = (unsigned long long)(flags | O_CLOEXEC);
  how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
  return (int)syscall(SYS_openat2, root, path, &how, sizeof how);
}

/** FILE.taking (a reflink of `clone_from`, when given) becomes the machine's disk image FILE, loop-mounted on `disk`. */
static void take_disk(const char *image, const char *clone_from, const char *rootfs, const char *disk) {
  char taking[4200];
  snprintf(taking, sizeof taking, "%s.taking", image);
  if (clone_from) {
    int src = open(clone_from, O_RDONLY | O_CLOEXEC);
    if (src < 0) die("open", clone_from);
    int dst = open(taking, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (dst < 0) die("create", taking);
    if (ioctl(dst, FICLONE, src)) die("reflink", taking);
    close(src);
    close(dst);
  }
  if (umount2(rootfs, MNT_DETACH)) die("umount", rootfs);
  if (umount2(disk, MNT_DETACH)) die("umount", disk);
  if (unlink(image) && errno != ENOENT) die("unlink", image);
  if (rename(taking, image)) die("rename", taking);
  int img = open(image, O_RDWR | O_CLOEXEC);
  if (img < 0) die("open", image);
  int ctl = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
  if (ctl < 0) die("open", "/dev/loop-control");
  for (int tries = 0;; tries++) {
    int n = ioctl(ctl, LOOP_CTL_GET_FREE);
    if (n < 0) die("get a free loop device", NULL);
    char dev[32];
    snprintf(dev, sizeof dev, "/dev/loop%d", n);
    int fd = open(dev, O_RDWR | O_CLOEXEC);
    if (fd < 0) die("open", dev);
    struct loop_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.fd = (unsigned)img;
    cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;
    strncpy((char *)cfg.info.lo_file_name, image, LO_NAME_SIZE - 1);
    if (ioctl(fd, LOOP_CONFIGURE, &cfg) == 0) {
      // The mount holds the device from here; closing ours lets it clear itself once unmounted.
      if (mount(dev, disk, "ext4", MS_NOATIME, "noinit_itable,nobarrier")) {
        int e = errno;
        ioctl(fd, LOOP_CLR_FD, 0);
        errno = e;
        die("mount", disk);
      }
      close(fd);
      break;
    }
    // Taken by another process between GET_FREE and CONFIGURE: try the next free one (bounded).
    if (errno != EBUSY || tries == 16) die("attach", dev);
    close(fd);
  }
  close(ctl);
  close(img);
}

/**
 * The mount namespace of PID, refused unless PID's root is ROOTFS (the machine's overlay, still mounted there): a pid
 * the driver recorded may since have gone to a process of another machine, whose processes must not be moved.
 * Opened first, checked after: a namespace that passes is one whose process had the machine's root.
 */
static int open_machine_ns(const char *pid, const char *rootfs) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%s/ns/mnt", pid);
  int ns = open(path, O_RDONLY | O_CLOEXEC);
  if (ns < 0) die("open", path);
  struct stat have, want;
  snprintf(path, sizeof path, "/proc/%s/root", pid);
  if (stat(path, &have)) die("stat", path);
  if (stat(rootfs, &want)) die("stat", rootfs);
  if (have.st_dev != want.st_dev || have.st_ino != want.st_ino) {
    fprintf(stderr, "kiln-idmount: process %s is not the machine's: its root is not %s\n", pid, rootfs);
    exit(1);
  }
  return ns;
}

static void swap_into(const char *pid, int ns, const char *rootfs) {
  char path[64];
  char *points[MAX_MOUNTS];
  int n = top_mounts(pid, points, MAX_MOUNTS);
  int tree = open_tree(AT_FDCWD, rootfs, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
  if (tree < 0) die("open_tree", rootfs);
  // A clone of a shared mount is its peer: where the host's mount of ROOTFS is shared (under systemd's shared /),
  // every mount placed in the machine's new root below would show up on the host too, and pivot_root(2) refuses a
  // shared root. A slave of it instead, as runc makes a machine's root: nothing of the machine reaches the host.
  struct mount_attr slave = {0};
  slave.propagation = MS_SLAVE;
  if (mount_setattr(tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &slave, sizeof slave)) die("make slave", rootfs);
  snprintf(path, sizeof path, "/proc/%s/ns/mnt", pid);
  // Our root and cwd become the machine's root.
  if (setns(ns, CLONE_NEWNS)) die("setns", path);
  close(ns);
  const char *stage = "/.kiln-root";
  if (mkdir(stage, 0700) && errno != EEXIST) die("mkdir", stage);
  if (move_mount(tree, "", AT_FDCWD, stage, MOVE_MOUNT_F_EMPTY_PATH)) die("move_mount", stage);
  close(tree);
  // Mount points are looked up inside the new root (its symlinks resolved as if it were /, as runc's securejoin
  // does): the new root is a copy of a machine's disk, whose files that machine's root controlled.
  int newroot = open(stage, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (newroot < 0) die("open", stage);
  for (int i = 0; i < n; i++) {
    const char *rel = points[i] + 1;
    struct stat st;
    if (stat(points[i], &st)) die("stat", points[i]);
    int dst = open_in_root(newroot, rel, O_PATH);
    if (dst < 0 && errno == ENOENT) {
      // The new root is a copy of a machine booted the same way: its mount points are there (made here if not).
      char parent[4096];
      snprintf(parent, sizeof parent, "%s", rel);
      char *slash = strrchr(parent, '/');
      const char *name = slash ? slash + 1 : parent;
      if (slash) *slash = '\0';
      int dir = slash ? open_in_root(newroot, parent, O_PATH | O_DIRECTORY) : dup(newroot);
      if (dir < 0) die("open", points[i]);
      if (S_ISDIR(st.st_mode)) {
        if (mkdirat(dir, name, 0755) && errno != EEXIST) die("mkdir", points[i]);
      } else {
        int f = openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (f < 0 && errno != EEXIST) die("create", points[i]);
        if (f >= 0) close(f);
      }
      close(dir);
      dst = open_in_root(newroot, rel, O_PATH);
    }
    if (dst < 0) die("open in the new root", points[i]);
    int fd = open_tree(AT_FDCWD, points[i], OPEN_TREE_CLONE | AT_RECURSIVE | OPEN_TREE_CLOEXEC);
    if (fd < 0) die("open_tree", points[i]);
    if (move_mount(fd, "", dst, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)) die("move_mount", points[i]);
    close(fd);
    close(dst);
  }
  close(newroot);
  // As runc does: pivot onto the new root with the old one stacked on it, then detach the old one.
  int old = open("/", O_DIRECTORY | O_PATH | O_CLOEXEC);
  if (old < 0) die("open", "/");
  if (chdir(stage)) die("chdir", stage);
  if (syscall(SYS_pivot_root, ".", ".")) die("pivot_root", stage);
  if (fchdir(old)) die("fchdir", "the old root");
  if (mount("", ".", NULL, MS_SLAVE | MS_REC, NULL)) die("make slave", "the old root");
  if (umount2(".", MNT_DETACH)) die("umount", "the old root");
  if (chdir("/")) die("chdir", "/");
  close(old);
}

static int freeze_clone(const char *mountpoint, const char *src, const char *dest) {
  int dir = open(mountpoint, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) die("open", mountpoint);
  int in = open(src, O_RDONLY | O_CLOEXEC);
  if (in < 0) die("open", src);
  int out = open(dest, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (out < 0) die("create", dest);
  if (ioctl(dir, FIFREEZE, 0)) {
    int e = errno;
    unlink(dest);
    errno = e;
    die("freeze", mountpoint);
  }
  int failed = ioctl(out, FICLONE, in) ? errno : 0;
  int thaw_failed = ioctl(dir, FITHAW, 0) ? errno : 0;
  if (failed || thaw_failed) {
    unlink(dest);
    errno = failed ? failed : thaw_failed;
    die(failed ? "reflink" : "thaw", failed ? dest : mountpoint);
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "probe") == 0) return probe(argc - 2, argv + 2);
  if (argc == 5 && strcmp(argv[1], "freeze-clone") == 0) return freeze_clone(argv[2], argv[3], argv[4]);
  if (argc < 2 || strcmp(argv[1], "boot") != 0) usage("usage: kiln-idmount probe DIR... | freeze-clone MOUNTPOINT SRC DEST | boot OPTIONS [-- COMMAND...]");

  struct userns_request machine = {0};
  const char *scratch = NULL, *disk = NULL, *rootfs = NULL, *idmap = NULL, *nofile = NULL, *swap_pid = NULL, *image = NULL, *clone_from = NULL;
  const char *upper = "upper", *work = "work";
  const char *lower[MAX_ITEMS], *bind_src[MAX_ITEMS], *bind_dst[MAX_ITEMS];
  int bind_ro[MAX_ITEMS];
  int lowers = 0, binds = 0, has_map = 0;
  unsigned long map_base = 0;
  char **command = NULL;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--") == 0) {
      if (i + 1 >= argc) usage("-- needs a command");
      command = argv + i + 1;
      break;
    }
    if (i + 1 >= argc) usage("an option lacks its value");
    const char *v = argv[++i];
    if (strcmp(a, "--userns") == 0) machine.link = v;
    else if (strcmp(a, "--owner") == 0) machine.owner = (uid_t)parse_num(v);
    else if (strcmp(a, "--map") == 0) map_base = parse_num(v), has_map = 1;
    else if (strcmp(a, "--sysctl") == 0) {
      if (machine.sysctls == MAX_SYSCTLS || !strchr(v, '=') || strchr(v, '/') || strlen(v) > 80) usage("bad --sysctl");
      machine.sysctl[machine.sysctls++] = v;
    } else if (strcmp(a, "--rlimit") == 0) {
      const char *eq = strchr(v, '=');
      int found = 0;
      for (size_t k = 0; eq && k < sizeof RLIMITS / sizeof RLIMITS[0]; k++) {
        if (strlen(RLIMITS[k].name) == (size_t)(eq - v) && strncmp(v, RLIMITS[k].name, eq - v) == 0 && machine.rlimits < 8) {
          machine.rlimit_res[machine.rlimits] = RLIMITS[k].resource;
          machine.rlimit_val[machine.rlimits++] = parse_num(eq + 1);
          found = 1;
        }
      }
      if (!found) usage("bad --rlimit");
    } else if (strcmp(a, "--idmap") == 0) idmap = v;
    else if (strcmp(a, "--scratch") == 0) scratch = v;
    else if (strcmp(a, "--lower") == 0) {
      if (lowers == MAX_ITEMS) usage("too many layers");
      lower[lowers++] = v;
    } else if (strcmp(a, "--disk") == 0) disk = v;
    else if (strcmp(a, "--rootfs") == 0) rootfs = v;
    else if (strcmp(a, "--bind") == 0 || strcmp(a, "--bind-ro") == 0) {
      if (binds == MAX_ITEMS || i + 1 >= argc) usage("bad --bind");
      bind_ro[binds] = a[6] == '-';
      bind_src[binds] = v;
      bind_dst[binds++] = argv[++i];
    } else if (strcmp(a, "--nofile") == 0) nofile = v;
    else if (strcmp(a, "--swap-into") == 0) {
      parse_num(v);
      swap_pid = v;
    } else if (strcmp(a, "--image") == 0) image = v;
    else if (strcmp(a, "--upper") == 0 || strcmp(a, "--work") == 0) {
      if (!*v || strlen(v) > 64 || strspn(v, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.") != strlen(v) || v[0] == '.') usage("bad --upper or --work");
      if (a[2] == 'u') upper = v;
      else work = v;
    }
    else if (strcmp(a, "--clone-from") == 0) clone_from = v;
    else usage("unknown option");
  }
  if (rootfs && (!scratch || !disk || lowers == 0)) usage("--rootfs needs --scratch, --disk and at least one --lower");
  if (machine.link && (!has_map || machine.owner == 0)) usage("--userns needs --owner and --map");
  if (binds > 0 && !idmap) usage("--bind needs --idmap");
  if (swap_pid && (!rootfs || command || machine.link || binds > 0)) usage("--swap-into needs --rootfs, and no --userns, --bind or COMMAND");
  if ((image || clone_from) && !swap_pid) usage("--image and --clone-from go with --swap-into");

  char machine_map[64], ids_map[96];
  struct userns_request ids = {0};
  if (machine.link) {
    snprintf(machine_map, sizeof machine_map, "0 %lu %d\n", map_base, MACHINE_IDS);
    machine.map = machine_map;
    start_userns(&machine);
  }
  if (idmap) {
    unsigned long canonical, base, count;
    if (sscanf(idmap, "%lu:%lu:%lu", &canonical, &base, &count) != 3 || canonical == 0) usage("bad --idmap");
    snprintf(ids_map, sizeof ids_map, "0 0 1\n%lu %lu %lu\n", canonical, base, count);
    ids.map = ids_map;
    ids.want_fd = 1;
    start_userns(&ids);
  }
  if (machine.link) finish_userns(&machine);
  int ns = idmap ? finish_userns(&ids) : -1;

  // Checked while the machine's root is still mounted at ROOTFS (take_disk detaches it).
  int machine_ns = swap_pid ? open_machine_ns(swap_pid, rootfs) : -1;
  if (swap_pid && image) take_disk(image, clone_from, rootfs, disk);
  else if (swap_pid && umount2(rootfs, MNT_DETACH)) die("umount", rootfs);
  if (rootfs) {
    // Overlayfs' option string is one page: layers go by short names relative to SCRATCH when idmapped.
    size_t cap = 64 + strlen(disk) * 2 + strlen(upper) + strlen(work);
    for (int i = 0; i < lowers; i++) cap += strlen(lower[i]) + 12;
    char *opts = malloc(cap);
    if (!opts) die("malloc", NULL);
    size_t n = (size_t)snprintf(opts, cap, "lowerdir=");
    if (ns >= 0) {
      if (mkdir(scratch, 0700) && errno != EEXIST) die("mkdir", scratch);
      if (chdir(scratch)) die("chdir", scratch);
      for (int i = 0; i < lowers; i++) {
        char name[16];
        snprintf(name, sizeof name, "%d", i);
        attach_idmapped(lower[i], name, ns, 1);
      }
      attach_idmapped(disk, "disk", ns, 0);
      for (int i = lowers - 1; i >= 0; i--) n += (size_t)snprintf(opts + n, cap - n, "%d%s", i, i ? ":" : "");
      snprintf(opts + n, cap - n, ",upperdir=disk/%s,workdir=disk/%s", upper, work);
    } else {
      for (int i = lowers - 1; i >= 0; i--) n += (size_t)snprintf(opts + n, cap - n, "%s%s", lower[i], i ? ":" : "");
      snprintf(opts + n, cap - n, ",upperdir=%s/%s,workdir=%s/%s", disk, upper, disk, work);
    }
    if (mount("overlay", rootfs, "overlay", 0, opts)) die("mount overlay on", rootfs);
    if (ns >= 0) {
      for (int i = 0; i < lowers; i++) {
        char name[16];
        snprintf(name, sizeof name, "%d", i);
        detach(name, 1);
      }
      detach("disk", 1);
    }
    free(opts);
  }

  for (int i = 0; i < binds; i++) attach_idmapped(bind_src[i], bind_dst[i], ns, bind_ro[i]);
  if (ns >= 0) close(ns);
  if (swap_pid) {
    swap_into(swap_pid, machine_ns, rootfs);
    return 0;
  }

  if (nofile) {
    unsigned long soft, hard;
    if (sscanf(nofile, "%lu:%lu", &soft, &hard) != 2 || soft > hard) usage("bad --nofile");
    struct rlimit l = {soft, hard};
    if (setrlimit(RLIMIT_NOFILE, &l)) die("setrlimit", "RLIMIT_NOFILE");
  }
  if (!command) return 0;

  pid_t pid = fork();
  if (pid < 0) die("fork", NULL);
  if (pid == 0) {
    execvp(command[0], command);
    die("exec", command[0]);
  }
  int status;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) die("wait", command[0]);
  }
  for (int i = 0; i < binds; i++) detach(bind_dst[i], 1);
  if (machine.link) release_userns(&machine);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

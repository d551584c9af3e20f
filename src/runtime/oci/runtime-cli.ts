// The OCI runtime's command line — runc, or gVisor's runsc — as the oci driver uses it: global flags, container
// names, the command that starts a machine, and state, list, pause, resume and delete under Kiln's own --root.

import { execHost } from "../host-commands.ts";
import { existsSync } from "node:fs";

// Started by the host command helper, not by the server's own thread (host-commands.ts).
const exec = execHost;

export type OciRuntime = "runc" | "runsc";
const CONTAINER_PREFIX = "kiln-";
/** Older runsc cannot network on Linux 6.x or stat with AT_NO_AUTOMOUNT (coreutils does), nor pass --oci-seccomp. */
export const RUNSC_MIN_RELEASE = "20240729";

/**
 * The runtime's name for a machine. runsc takes any unambiguous prefix of a name as that name, so `delete kiln-a`
 * could reach `kiln-ab`; a suffix with a character machine ids never hold makes no name a prefix of another.
 */
export function containerName(runtime: OciRuntime, id: string): string {
  return runtime === "runsc" ? `${CONTAINER_PREFIX}${id}.m` : CONTAINER_PREFIX + id;
}

/** The machine id a container name stands for, or undefined for a container that is not one of Kiln's. */
function machineIdOf(runtime: OciRuntime, name: string): string | undefined {
  const suffix = containerName(runtime, "").slice(CONTAINER_PREFIX.length);
  if (!name.startsWith(CONTAINER_PREFIX) || !name.endsWith(suffix)) return undefined;
  return name.slice(CONTAINER_PREFIX.length, name.length - suffix.length);
}

export interface RunRequest {
  id: string;
  bundleDir: string;
  pidFile: string;
  internet: boolean;
  /** runc: the listening socket at fd 3 is handed to the machine's first process. */
  passListener: boolean;
  /** runsc: continue the machine saved in this checkpoint image dir instead of starting its first process. */
  restoreFrom?: string;
}

export interface ContainerState {
  id: string;
  pid: number;
  status: string;
}

export function createRuntimeCli(opts: { runtime: OciRuntime; stateRoot: string; runscPlatform?: "ptrace" | "systrap" | "kvm" }) {
  const { runtime } = opts;
  const name = (id: string) => containerName(runtime, id);
  const gone = (err: Error) => /does not exist|not found|no such/i.test(err.message);

  /**
   * runsc: the configured platform (ptrace unless told: KVM is unusable on these hosts), host-uds so the agent's
   * socket works across the bind mount, no overlay of its own (writes go to the machine's overlayfs upper dir, so
   * they survive a restart and count as the machine's disk), and the spec's seccomp profile inside the sandbox.
   */
  function globalArgs(): string[] {
    const args = ["--root", opts.stateRoot];
    if (runtime === "runsc") args.push(`--platform=${opts.runscPlatform ?? "ptrace"}`, "--host-uds=all", "--overlay2=none", "--oci-seccomp");
    return args;
  }

  /** Every call but `run` goes through here, so every failure names the command and says why. */
  async function call(args: string[], timeoutMs = 30_000): Promise<string> {
    try {
      const { stdout } = await exec(runtime, [...globalArgs(), ...args], { timeout: timeoutMs, maxBuffer: 16 * 1024 * 1024 });
      return stdout;
    } catch (err) {
      const e = err as { stderr?: string; message: string; killed?: boolean };
      const why = e.killed ? `timed out after ${timeoutMs} ms` : (e.stderr || e.message).trim().slice(-600);
      throw new Error(`${runtime} ${args.join(" ")} failed: ${why}`);
    }
  }

  return {
    runtime,
    name,

    /**
     * The command line that starts a machine, detached. runsc with a network decides it is in the host's root
     * namespace when /proc/sys/net/core/rmem_default exists — which Linux 6.x shows in every namespace — and refuses
     * to start, so it runs in a private mount namespace of its own with /proc/sys/net hidden under an empty tmpfs.
     */
    runCommand(req: RunRequest): [string, string[]] {
      const network = runtime === "runsc" ? [`--network=${req.internet ? "sandbox" : "none"}`] : [];
      const fds = req.passListener ? ["--preserve-fds", "1"] : [];
      const verb = req.restoreFrom ? ["restore", "--image-path", req.restoreFrom] : ["run"];
      const args = [...globalArgs(), ...network, ...verb, "--detach", "--pid-file", req.pidFile, ...fds, "--bundle", req.bundleDir, name(req.id)];
      // With umask 022, not Kiln's 077: what the runtime makes for the machine (its cgroup dirs, mount points in its
      // root) must stay readable by the machine's own users (its OOM counters, for one).
      const umask = "umask 022 && ";
      if (runtime !== "runsc" || !req.internet) return ["/bin/sh", ["-c", umask + 'exec "$0" "$@"', runtime, ...args]];
      const hide = umask + 'mount -t tmpfs -o size=4k,mode=555 kiln-hidden /proc/sys/net && exec "$0" "$@"';
      return ["unshare", ["--mount", "--propagation", "private", "sh", "-c", hide, runtime, ...args]];
    },

    async version(): Promise<string> {
      return (await exec(runtime, ["--version"])).stdout.split("\n")[0];
    },

    async state(id: string): Promise<ContainerState | undefined> {
      try {
        return JSON.parse(await call(["state", name(id)], 10_000)) as ContainerState;
      } catch (err) {
        if (gone(err as Error)) return undefined;
        throw err;
      }
    },

    /** runsc: names the UTS namespace of a restored machine (machine root lacks CAP_SYS_ADMIN to do it itself). */
    async setHostname(id: string, hostname: string): Promise<void> {
      await call(["exec", "--user", "0:0", "--cap", "CAP_SYS_ADMIN", name(id), "hostname", hostname], 10_000);
    },

    async kill(id: string, signal: string): Promise<void> {
      await call(["kill", name(id), signal], 10_000);
    },

    /** runsc: saves the sandbox (memory, processes) into `imageDir`; the sandbox stops once saved. */
    async checkpoint(id: string, imageDir: string): Promise<void> {
      // Uncompressed: runsc's default (flate) spent most of a memory snapshot compressing the machine's memory (and
      // its restore inflating it); the image is as large as the memory in use, which the disk floor admits. Written
      // with O_DIRECT: through the page cache, a host busy writing elsewhere throttled runsc's writes of a 256 MiB
      // machine to 1.7–5.5 s; direct, 0.4–0.8 s (measured side by side, docs/snapshots.md).
      await call(["checkpoint", "--compression=none", "--direct", "--image-path", imageDir, name(id)], 120_000);
    },

    async pause(id: string): Promise<void> {
      await call(["pause", name(id)]);
    },

    async resume(id: string): Promise<void> {
      await call(["resume", name(id)]);
    },

    /** Kills and deletes the container; also clears a runtime state left by a crash (delete --force). */
    async remove(id: string): Promise<void> {
      try {
        await call(["delete", "--force", name(id)], 20_000);
      } catch (err) {
        if (gone(err as Error)) return;
        // A frozen container cannot be killed on cgroup v1 until it is thawed.
        await call(["resume", name(id)], 10_000).catch(() => undefined);
        await call(["delete", "--force", name(id)], 20_000).catch((again: Error) => {
          if (!gone(again)) throw again;
        });
      }
    },

    /** Kiln's containers under its --root, by machine id. */
    async list(): Promise<ContainerState[]> {
      if (!existsSync(opts.stateRoot)) return [];
      const all = JSON.parse((await call(["list", "--format", "json"], 20_000)).trim() || "null") as ContainerState[] | null;
      return (all ?? []).flatMap((c) => {
        const id = machineIdOf(runtime, c.id);
        return id === undefined ? [] : [{ ...c, id }];
      });
    },
  };
}

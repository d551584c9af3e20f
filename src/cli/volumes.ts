// `kiln volumes create|ls|get|rm|watch`: volumes for people, over the HTTP API; `watch` prints a volume's file
// events live from its WebSocket until interrupted.

import type { Command } from "commander";
import { WebSocket } from "ws";
import { apiClient, fail, listAll } from "./client.ts";
import type { VolumeView } from "../volumes/service.ts";

export function volumeCommands(program: Command) {
  const volumes = program.command("volumes").alias("v").description("Create, list, delete and watch volumes shared between machines");

  volumes
    .command("create <name>")
    .description("Create a volume and print its id; mount it with POST /v1/machines {volumes: [{volume_id, path}]}")
    .option("--size-mb <mb>", "size limit in MiB (default 1024)", (v) => Number(v))
    .option("--json", "print the whole record")
    .action(async (name: string, opts: { sizeMb?: number; json?: boolean }) => {
      const v = await apiClient().call<VolumeView>("POST", "/v1/volumes", { name, size_mb: opts.sizeMb });
      process.stdout.write(opts.json ? JSON.stringify(v, null, 2) + "\n" : v.id + "\n");
    });

  volumes
    .command("ls")
    .alias("list")
    .description("List volumes")
    .action(async () => {
      const client = apiClient();
      for await (const v of listAll<VolumeView>(client, "/v1/volumes", "volumes")) process.stdout.write(`${v.id}\t${v.name}\t${v.size_mb} MiB\t${v.created_at}\n`);
    });

  volumes
    .command("get <id>")
    .description("Print a volume's record")
    .action(async (id: string) => {
      process.stdout.write(JSON.stringify(await apiClient().call("GET", `/v1/volumes/${id}`), null, 2) + "\n");
    });

  volumes
    .command("rm <ids...>")
    .description("Delete volumes and their data (refused while a live machine mounts one)")
    .action(async (ids: string[]) => {
      const client = apiClient();
      for (const id of ids) {
        await client.call("DELETE", `/v1/volumes/${id}`);
        process.stdout.write(`${id} deleted\n`);
      }
    });

  volumes
    .command("watch <id> <path>")
    .description("Print file events under a volume path as they happen (Ctrl-C stops)")
    .option("--no-recursive", "only the path itself and its direct children")
    .option("--json", "print the raw frames")
    .action(async (id: string, path: string, opts: { recursive: boolean; json?: boolean }) => {
      const client = apiClient();
      const url = client.baseUrl.replace(/^http/, "ws") + `/v1/volumes/${id}/ws`;
      const ws = new WebSocket(url, { headers: { authorization: `Bearer ${client.key}` } });
      ws.on("unexpected-response", (_req, res) => {
        let body = "";
        res.on("data", (d: Buffer) => (body += d));
        res.on("end", () => {
          const env = (() => {
            try {
              return JSON.parse(body) as { code?: string; error?: string };
            } catch {
              return {};
            }
          })();
          fail(`${env.code ?? res.statusCode}: ${env.error ?? body}`);
        });
      });
      ws.on("error", (err) => fail(`cannot watch: ${err.message}`));
      ws.on("open", () => ws.send(JSON.stringify({ type: "file_watch", request_id: "cli", path, recursive: opts.recursive })));
      ws.on("message", (data) => {
        const f = JSON.parse(data.toString()) as Record<string, unknown>;
        if (opts.json) return void process.stdout.write(JSON.stringify(f) + "\n");
        const time = new Date().toISOString().slice(11, 23);
        if (f.type === "file_watch.started") process.stderr.write(`watching ${String(f.path)}${opts.recursive ? " (recursive)" : ""}\n`);
        else if (f.type === "file_event") process.stdout.write(`${time} ${String(f.event).padEnd(6)} ${String(f.path)}${f.is_dir ? "/" : ""}\n`);
        else if (f.type === "resync_required") process.stdout.write(`${time} resync ${String(f.path)} (${String(f.reason)}: events may have been lost; list the tree again)\n`);
        else if (f.type === "error") fail(`${String(f.code)}: ${String(f.error)}`);
      });
      ws.on("close", (code, reason) => {
        process.stderr.write(`socket closed (${code}${reason.length ? ` ${reason.toString()}` : ""})\n`);
        process.exit(code === 1000 ? 0 : 1);
      });
      process.on("SIGINT", () => ws.close(1000));
    });
}

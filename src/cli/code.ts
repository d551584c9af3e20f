// `kiln code run|create|contexts|rm`: the code interpreter for people. `run` streams an execute's frames as they come:
// stdout and results to stdout, stderr and errors to stderr, and exits non-zero when the execute did not end ok.

import type { Command } from "commander";
import { readFileSync } from "node:fs";
import { request } from "undici";
import { apiClient, fail } from "./client.ts";

interface Frame {
  type: string;
  text?: string;
  data?: Record<string, string>;
  name?: string;
  value?: string;
  traceback?: string;
  status?: string;
}

export function codeCommands(program: Command) {
  const code = program.command("code").description("Run code in a machine's kernels (talks to a running server)");

  code
    .command("run")
    .description("Run code (from the argument, or stdin when it is absent or '-') and stream what it prints")
    .argument("<machine>")
    .argument("[code]")
    .option("-l, --language <language>", "python or javascript: that language's default context")
    .option("-c, --context <ctx_id>", "a context made with kiln code create (or the API)")
    .option("--timeout <seconds>", "interrupt the execution after this many seconds", (v) => Number(v))
    .action(async (machine: string, text: string | undefined, opts: { language?: string; context?: string; timeout?: number }) => {
      const client = apiClient();
      const source = text === undefined || text === "-" ? readFileSync(0, "utf8") : text;
      const res = await request(`${client.baseUrl}/v1/machines/${machine}/code/execute`, {
        method: "POST",
        headers: { authorization: `Bearer ${client.key}`, "content-type": "application/json" },
        body: JSON.stringify({ code: source, context_id: opts.context, language: opts.language, timeout_s: opts.timeout }),
      }).catch((err: Error) => fail(`cannot reach ${client.baseUrl}: ${err.message}`));
      if (res.statusCode !== 200) {
        const body = (await res.body.json().catch(() => ({}))) as { code?: string; error?: string };
        fail(`${body.code ?? res.statusCode}: ${body.error ?? "execute failed"}`);
      }
      let status = "error";
      let pending = "";
      for await (const chunk of res.body) {
        pending += chunk.toString();
        let nl: number;
        while ((nl = pending.indexOf("\n")) >= 0) {
          const frame = JSON.parse(pending.slice(0, nl)) as Frame;
          pending = pending.slice(nl + 1);
          if (frame.type === "stdout") process.stdout.write(frame.text ?? "");
          else if (frame.type === "stderr") process.stderr.write(frame.text ?? "");
          else if (frame.type === "result") process.stdout.write((frame.data?.["text/plain"] ?? Object.keys(frame.data ?? {}).join(", ")) + "\n");
          else if (frame.type === "error") process.stderr.write((frame.traceback || `${frame.name}: ${frame.value}`) + "\n");
          else if (frame.type === "end") status = frame.status ?? "error";
        }
      }
      if (status !== "ok") process.exitCode = 1;
    });

  code
    .command("create")
    .description("Create a context (its own kernel, whose state persists across runs) and print its id")
    .argument("<machine>")
    .option("-l, --language <language>", "python or javascript", "python")
    .option("--cwd <dir>", "the kernel's working directory")
    .option("--json", "print the whole record")
    .action(async (machine: string, opts: { language: string; cwd?: string; json?: boolean }) => {
      const ctx = await apiClient().call<{ id: string }>("POST", `/v1/machines/${machine}/code/contexts`, { language: opts.language, cwd: opts.cwd });
      process.stdout.write(opts.json ? JSON.stringify(ctx, null, 2) + "\n" : ctx.id + "\n");
    });

  code
    .command("contexts")
    .description("List a machine's contexts")
    .argument("<machine>")
    .action(async (machine: string) => {
      const { contexts } = await apiClient().call<{ contexts: { id: string; language: string; cwd: string }[] }>("GET", `/v1/machines/${machine}/code/contexts`);
      for (const c of contexts) process.stdout.write(`${c.id}\t${c.language}\t${c.cwd}\n`);
    });

  code
    .command("rm")
    .description("Remove a context (its kernel stops)")
    .argument("<machine>")
    .argument("<ctx_id>")
    .action(async (machine: string, ctx: string) => {
      await apiClient().call("DELETE", `/v1/machines/${machine}/code/contexts/${ctx}`);
    });
}

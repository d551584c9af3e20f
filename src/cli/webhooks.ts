// `kiln webhooks create|update|ls|get|rm|deliveries|retry|replay`: lifecycle webhooks for people, over HTTP.

import type { Command } from "commander";
import { apiClient, listAll } from "./client.ts";
import type { DeliveryView, WebhookView } from "../webhooks/service.ts";

const collect = (v: string, prev: string[] = []) => [...prev, ...v.split(",").filter(Boolean)];

const ALLOW_PRIVATE_HELP =
  "let it reach private and loopback receivers (e.g. http://localhost:9000) without KILN_WEBHOOK_ALLOW_PRIVATE: needs the operator's key; deliveries refused for the address go again at once";

export function webhookCommands(program: Command) {
  const hooks = program.command("webhooks").alias("wh").description("Lifecycle webhooks: registrations and their deliveries (talks to a running server)");

  hooks
    .command("create <url>")
    .description("Register a webhook; prints its id and, when Kiln made it, the signing secret (shown only this once)")
    .option("-o, --operation <op>", "lifecycle operation to receive (repeatable or comma list; default create,destroy): create, update, hibernate, resume, destroy", collect)
    .option("--secret-stdin", "read the signing secret from stdin instead of letting Kiln make one")
    .option("--allow-private", ALLOW_PRIVATE_HELP)
    .option("--json", "print the whole record")
    .action(async (url: string, opts: { operation?: string[]; secretStdin?: boolean; allowPrivate?: boolean; json?: boolean }) => {
      let signing_secret: string | undefined;
      if (opts.secretStdin) {
        const chunks: Buffer[] = [];
        for await (const c of process.stdin) chunks.push(c as Buffer);
        signing_secret = Buffer.concat(chunks).toString("utf8").trim();
      }
      const hook = await apiClient().call<WebhookView & { signing_secret?: string }>("POST", "/v1/lifecycle/webhooks", {
        url,
        operations: opts.operation ?? ["create", "destroy"],
        signing_secret,
        allow_private: opts.allowPrivate,
      });
      if (opts.json) process.stdout.write(JSON.stringify(hook, null, 2) + "\n");
      else {
        process.stdout.write(hook.id + "\n");
        if (hook.signing_secret) {
          process.stderr.write("signing secret (shown only now; keep it where your receiver can read it):\n");
          process.stdout.write(hook.signing_secret + "\n");
        }
      }
    });

  hooks
    .command("update <id>")
    .description("Change a webhook: its url, operations, whether it is enabled or may reach private receivers")
    .option("--url <url>", "a new receiver url")
    .option("-o, --operation <op>", "the operations to receive (repeatable or comma list; replaces them)", collect)
    .option("--allow-private", ALLOW_PRIVATE_HELP)
    .option("--no-allow-private", "judge its receiver like any other webhook's again")
    .option("--enable", "send its deliveries again")
    .option("--disable", "hold its deliveries")
    .action(async (id: string, opts: { url?: string; operation?: string[]; allowPrivate?: boolean; enable?: boolean; disable?: boolean }) => {
      const hook = await apiClient().call<WebhookView>("PATCH", `/v1/lifecycle/webhooks/${id}`, {
        url: opts.url,
        operations: opts.operation,
        allow_private: opts.allowPrivate,
        enabled: opts.enable ? true : opts.disable ? false : undefined,
      });
      process.stdout.write(`${hook.id}\t${hook.url}\t${hook.enabled ? "enabled" : "disabled"}${hook.allow_private ? "\tprivate receivers allowed" : ""}\n`);
    });

  hooks
    .command("ls")
    .alias("list")
    .description("List webhooks")
    .action(async () => {
      const client = apiClient();
      for await (const h of listAll<WebhookView>(client, "/v1/lifecycle/webhooks", "webhooks")) {
        process.stdout.write(`${h.id}\t${h.enabled ? "enabled" : "disabled"}\t${h.operations.join(",")}\t${h.url}\n`);
      }
    });

  hooks
    .command("get <id>")
    .description("Print a webhook's record")
    .action(async (id: string) => {
      process.stdout.write(JSON.stringify(await apiClient().call("GET", `/v1/lifecycle/webhooks/${id}`), null, 2) + "\n");
    });

  hooks
    .command("rm <ids...>")
    .description("Delete webhooks (their pending deliveries are not sent)")
    .action(async (ids: string[]) => {
      const client = apiClient();
      for (const id of ids) {
        await client.call("DELETE", `/v1/lifecycle/webhooks/${id}`);
        process.stdout.write(`${id} deleted\n`);
      }
    });

  hooks
    .command("deliveries <id> [delivery_id]")
    .description("List a webhook's deliveries, newest first, or show one with every attempt")
    .option("-s, --status <status>", "only deliveries in this status: queued, in_progress, succeeded, dead_letter")
    .option("-n, --limit <n>", "how many (1-100)", "20")
    .action(async (id: string, deliveryId: string | undefined, opts: { status?: string; limit: string }) => {
      const client = apiClient();
      if (deliveryId) {
        process.stdout.write(JSON.stringify(await client.call("GET", `/v1/lifecycle/webhooks/${id}/deliveries/${deliveryId}`), null, 2) + "\n");
        return;
      }
      const q = new URLSearchParams({ limit: opts.limit });
      if (opts.status) q.set("status", opts.status);
      const page: { deliveries: DeliveryView[] } = await client.call("GET", `/v1/lifecycle/webhooks/${id}/deliveries?${q}`);
      for (const d of page.deliveries) {
        const last = d.attempts.at(-1);
        const outcome = last ? (last.status_code ?? last.error ?? "") : "";
        process.stdout.write(`${d.id}\t${d.status}\t${d.operation}\t${d.event_id}\t${d.attempts.length} attempt(s)\t${outcome}\n`);
      }
    });

  hooks
    .command("retry <id> <delivery_id>")
    .description("Queue a dead_letter delivery again")
    .action(async (id: string, deliveryId: string) => {
      const d = await apiClient().call<DeliveryView>("POST", `/v1/lifecycle/webhooks/${id}/deliveries/${deliveryId}/retry`);
      process.stdout.write(`${d.id} ${d.status}\n`);
    });

  hooks
    .command("replay <id> <delivery_id>")
    .description("Send a delivery's event again as a new delivery (any status); prints the new delivery")
    .action(async (id: string, deliveryId: string) => {
      const d = await apiClient().call<DeliveryView>("POST", `/v1/lifecycle/webhooks/${id}/deliveries/${deliveryId}/replay`);
      process.stdout.write(`${d.id} ${d.status}\n`);
    });
}

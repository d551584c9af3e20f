// Lifecycle webhooks and their deliveries: register one (the signing secret is typed in a password field and
// never shown again), see each delivery's attempts, retry a dead letter and replay any delivery as a new one.

import { useState } from "preact/hooks";
import { api, enc, get, type Delivery, type Webhook } from "../api.ts";
import { href } from "../router.ts";
import { age, ConfirmButton, Empty, ErrorNote, Section, Status, useAction, useLoad, when } from "../ui.tsx";

const OPERATIONS = ["create", "hibernate", "resume", "destroy", "update"];

export function Webhooks() {
  const list = useLoad((signal) => get<{ webhooks: Webhook[] }>("/v1/lifecycle/webhooks?limit=100", signal), []);
  const hooks = list.data?.webhooks ?? [];
  return (
    <>
      <CreateWebhook onCreated={list.reload} />
      <Section title="Webhooks">
        <ErrorNote error={list.error} />
        {list.data && hooks.length === 0 ? (
          <Empty title="No webhooks yet">
            <p>A webhook receives a signed POST for each machine lifecycle event it subscribes to. Register a receiver above; its deliveries, with every attempt, show here.</p>
          </Empty>
        ) : (
          <table class="list" aria-label="Webhooks">
            <thead>
              <tr>
                <th>Receiver</th>
                <th>Operations</th>
                <th>Enabled</th>
                <th>Age</th>
              </tr>
            </thead>
            <tbody>
              {hooks.map((w) => (
                <tr>
                  <td>
                    <a href={href("webhooks", w.id)}>{w.url}</a> <span class="muted">{w.id}</span>
                  </td>
                  <td>{w.operations.join(", ")}</td>
                  <td>{w.enabled ? "yes" : "no"}</td>
                  <td>{age(w.created_at)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
      </Section>
    </>
  );
}

function CreateWebhook({ onCreated }: { onCreated: () => void }) {
  const [url, setUrl] = useState("");
  const [secret, setSecret] = useState("");
  const [ops, setOps] = useState(new Set(["create", "destroy"]));
  const [error, run, busy] = useAction();
  return (
    <form
      class="inline-form"
      aria-label="Register a webhook"
      onSubmit={(e) => {
        e.preventDefault();
        void run(async () => {
          await api("POST", "/v1/lifecycle/webhooks", { url: url.trim(), operations: [...ops], signing_secret: secret });
          setUrl("");
          setSecret("");
          onCreated();
        });
      }}
    >
      <label>
        Receiver URL
        <input type="url" required value={url} onInput={(e) => setUrl((e.target as HTMLInputElement).value)} />
      </label>
      <label>
        Signing secret
        <input type="password" required minLength={16} autocomplete="off" value={secret} onInput={(e) => setSecret((e.target as HTMLInputElement).value)} />
      </label>
      <fieldset>
        <legend>Operations</legend>
        {OPERATIONS.map((op) => (
          <label class="check">
            <input
              type="checkbox"
              checked={ops.has(op)}
              onChange={(e) => {
                const next = new Set(ops);
                if ((e.target as HTMLInputElement).checked) next.add(op);
                else next.delete(op);
                setOps(next);
              }}
            />
            {op}
          </label>
        ))}
      </fieldset>
      <button type="submit" disabled={busy || ops.size === 0}>
        Register webhook
      </button>
      <ErrorNote error={error} />
    </form>
  );
}

export function WebhookPage({ id }: { id: string }) {
  const hook = useLoad((signal) => get<Webhook>(`/v1/lifecycle/webhooks/${enc(id)}`, signal), [id]);
  const deliveries = useLoad((signal) => get<{ deliveries: Delivery[] }>(`/v1/lifecycle/webhooks/${enc(id)}/deliveries?limit=100`, signal), [id], 3000);
  const [error, run] = useAction();
  const [enabledError, toggle, busy] = useAction();
  const [replayed, setReplayed] = useState<{ from: string; to: string }>();
  const w = hook.data;
  return (
    <Section
      title={
        <>
          <a href={href("webhooks")}>Webhooks</a> / {w?.url ?? id}
        </>
      }
      actions={
        w ? (
          <>
            <button type="button" disabled={busy} onClick={() => toggle(async () => (await api("PATCH", `/v1/lifecycle/webhooks/${enc(id)}`, { enabled: !w.enabled }), hook.reload()))}>
              {w.enabled ? "Disable" : "Enable"}
            </button>
            <ConfirmButton label="Delete" confirm="Really delete?" onConfirm={() => run(async () => (await api("DELETE", `/v1/lifecycle/webhooks/${enc(id)}`), (location.hash = href("webhooks"))))} />
          </>
        ) : null
      }
    >
      <ErrorNote error={hook.error ?? deliveries.error ?? error ?? enabledError} />
      {replayed ? (
        <p class="notice" role="status">
          Replayed {replayed.from} as {replayed.to}.
        </p>
      ) : null}
      {deliveries.data && deliveries.data.deliveries.length === 0 ? (
        <Empty title="No deliveries yet">
          <p>Deliveries appear here when a subscribed lifecycle event happens (create a machine to see one).</p>
        </Empty>
      ) : null}
      {deliveries.data && deliveries.data.deliveries.length > 0 ? (
        <table class="list" aria-label="Deliveries">
          <thead>
            <tr>
              <th>Delivery</th>
              <th>Operation</th>
              <th>Status</th>
              <th>Attempts</th>
              <th>Last answer</th>
              <th>Next attempt</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {deliveries.data.deliveries.map((d) => (
              <tr data-delivery={d.id}>
                <td title={when(d.created_at)}>{d.id}</td>
                <td>{d.operation}</td>
                <td>
                  <Status value={d.status} />
                </td>
                <td title={d.attempts.map((a) => `#${a.attempt} ${a.status_code ?? a.error ?? "?"} in ${a.duration_ms} ms`).join("\n")}>{d.attempts.length}</td>
                <td>{d.last_status_code ?? d.last_error ?? "—"}</td>
                <td>{d.next_attempt_at ? when(d.next_attempt_at) : "—"}</td>
                <td class="row-actions">
                  {d.status === "dead_letter" ? (
                    <button type="button" onClick={() => run(async () => (await api("POST", `/v1/lifecycle/webhooks/${enc(id)}/deliveries/${enc(d.id)}/retry`), deliveries.reload()))}>
                      Retry
                    </button>
                  ) : null}
                  <button
                    type="button"
                    title="Send this event again as a new delivery"
                    data-replay={d.id}
                    onClick={() =>
                      run(async () => {
                        const fresh = await api<Delivery>("POST", `/v1/lifecycle/webhooks/${enc(id)}/deliveries/${enc(d.id)}/replay`);
                        setReplayed({ from: d.id, to: fresh.id });
                        deliveries.reload();
                      })
                    }
                  >
                    Replay
                  </button>
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : null}
    </Section>
  );
}

// Hosts: every server sharing this store (GET /v1/hosts, where the server has it), each drained or activated in
// place (POST /v1/hosts/{id}/drain|activate: the operator's key), and this server's readiness and capacity
// (GET /v1/ready).

import { useEffect, useState } from "preact/hooks";
import { ApiError, api, authHeaders, enc, get, hasRoute } from "../api.ts";
import { ConfirmButton, Empty, ErrorNote, Section, Status, age, bytes, useAction, useLoad } from "../ui.tsx";

interface Host {
  id: string;
  name: string;
  advertise_url: string;
  status: string;
  heartbeat_at: string;
}

interface Ready {
  status: string;
  store: { dialect: string; ok: boolean };
  driver: Record<string, unknown>;
  capacity: { host_cores: number; host_memory_mb: number; live_machines: number; mem_available_mb: number; free_disk_mb: number | null; accepting: boolean };
}

/**
 * One host, with the action its status allows: drain an active host (asks first: new machines stop going there),
 * activate a draining one. The row shows what the server answered; a refusal (403 without the operator's key, 409
 * for a lost host) shows beside the button.
 */
function HostRow({ host, onChanged }: { host: Host; onChanged: () => void }) {
  // The action's answer is shown at once, until the list's next read (which has the change) replaces it.
  const [answer, setAnswer] = useState<Host>();
  useEffect(() => setAnswer(undefined), [host]);
  const [error, run, busy] = useAction();
  const h = answer ?? host;
  const act = (action: "drain" | "activate") =>
    run(async () => {
      setAnswer(await api<Host>("POST", `/v1/hosts/${enc(h.id)}/${action}`));
      onChanged();
    });
  return (
    <tr data-host={h.id}>
      <td>
        {h.name} <span class="muted">{h.id}</span>
      </td>
      <td>
        <Status value={h.status} />
      </td>
      <td>{h.advertise_url}</td>
      <td>{age(h.heartbeat_at)} ago</td>
      <td>
        <div class="actions">
          {h.status === "active" ? <ConfirmButton label="Drain" confirm="Really drain? No new machines go there" onConfirm={() => act("drain")} /> : null}
          {h.status === "draining" ? (
            <button type="button" disabled={busy} onClick={() => act("activate")}>
              Activate
            </button>
          ) : null}
        </div>
        <ErrorNote error={error} />
      </td>
    </tr>
  );
}

export function Hosts() {
  const hosts = useLoad(async (signal) => ((await hasRoute("/v1/hosts")) ? get<{ hosts: Host[] }>("/v1/hosts", signal) : null), [], 5000);
  // /v1/ready answers 503 with the same report while not ready: both are worth showing.
  const ready = useLoad(async (signal) => {
    try {
      return await get<Ready>("/v1/ready", signal);
    } catch (err) {
      if (err instanceof ApiError && err.status === 503) return (await (await fetch("/v1/ready", { headers: authHeaders(), signal })).json()) as Ready;
      throw err;
    }
  }, [], 5000);
  const single = hosts.data === null;
  const r = ready.data;
  return (
    <>
      <Section title="Hosts">
        {single ? (
          <Empty title="One host">
            <p class="muted">This server runs alone (no multi-host API here): every machine is on it.</p>
          </Empty>
        ) : (
          <>
            <ErrorNote error={hosts.error} />
            {hosts.data ? (
              <table class="list" aria-label="Hosts">
                <thead>
                  <tr>
                    <th>Host</th>
                    <th>Status</th>
                    <th>Address</th>
                    <th>Heartbeat</th>
                    <th></th>
                  </tr>
                </thead>
                <tbody>
                  {hosts.data.hosts.map((h) => (
                    <HostRow key={h.id} host={h} onChanged={hosts.reload} />
                  ))}
                </tbody>
              </table>
            ) : null}
          </>
        )}
      </Section>
      <Section title="This server">
        <ErrorNote error={ready.error} />
        {r ? (
          <dl class="facts" aria-label="Readiness">
            <dt>Ready</dt>
            <dd>
              <Status value={r.status} />
            </dd>
            <dt>Store</dt>
            <dd>
              {r.store.dialect} {r.store.ok ? "ok" : "failing"}
            </dd>
            <dt>Runtime</dt>
            <dd>{String(r.driver.runtime ?? r.driver.name ?? "—")}</dd>
            <dt>Machines</dt>
            <dd>{r.capacity.live_machines} live</dd>
            <dt>Host</dt>
            <dd>
              {r.capacity.host_cores} cores, {bytes(r.capacity.mem_available_mb * 1048576)} of {bytes(r.capacity.host_memory_mb * 1048576)} memory available,{" "}
              {r.capacity.free_disk_mb === null ? "disk unknown" : `${bytes(r.capacity.free_disk_mb * 1048576)} disk free`}
            </dd>
            <dt>Accepting creates</dt>
            <dd>{r.capacity.accepting ? "yes" : "no: a floor is crossed"}</dd>
          </dl>
        ) : null}
      </Section>
    </>
  );
}

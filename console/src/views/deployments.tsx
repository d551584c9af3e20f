// Agent deployments and their services: status, port, backing machine and public URL (the URL carries a signed
// edge token: shown as a link, never logged), with restart per service.

import { api, enc, get } from "../api.ts";
import { href } from "../router.ts";
import { age, ConfirmButton, Empty, ErrorNote, Section, Status, useAction, useLoad } from "../ui.tsx";

interface Deployment {
  id: string;
  name: string;
  status: string;
  version: number;
  template: string;
  command: string;
  port: number;
  replicas: number;
  rollout_status: string;
  rollout_error: string | null;
  created_at: string;
}

interface Service {
  id: string;
  status: string;
  port: number;
  machine_id: string;
  process_id: number | null;
  public_url: string | null;
  failure_reason: string | null;
  started_at: string | null;
}

export function Deployments() {
  const list = useLoad((signal) => get<{ deployments: Deployment[] }>("/v1/agent-deployments?limit=100", signal), [], 5000);
  const deployments = list.data?.deployments ?? [];
  return (
    <Section title="Deployments">
      <ErrorNote error={list.error} />
      {list.data && deployments.length === 0 ? (
        <Empty title="No deployments yet">
          <p>
            A deployment runs a long-lived service (an agent, a web app) in its own machine with a public URL:{" "}
            <code>bin/kiln deployments create --name web -c 'python3 -m http.server 8000' -p 8000</code>.
          </p>
        </Empty>
      ) : (
        <table class="list" aria-label="Deployments">
          <thead>
            <tr>
              <th>Deployment</th>
              <th>Status</th>
              <th>Rollout</th>
              <th>Command</th>
              <th>Replicas</th>
              <th>Age</th>
            </tr>
          </thead>
          <tbody>
            {deployments.map((d) => (
              <tr>
                <td>
                  <a href={href("deployments", d.id)}>{d.name}</a> <span class="muted">v{d.version}</span>
                </td>
                <td>
                  <Status value={d.status} />
                </td>
                <td>
                  {d.rollout_status}
                  {d.rollout_error ? <span class="error"> {d.rollout_error}</span> : null}
                </td>
                <td>
                  <code>{d.command}</code> :{d.port}
                </td>
                <td>{d.replicas}</td>
                <td>{age(d.created_at)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </Section>
  );
}

export function DeploymentPage({ id }: { id: string }) {
  const dep = useLoad((signal) => get<Deployment>(`/v1/agent-deployments/${enc(id)}`, signal), [id]);
  const services = useLoad((signal) => get<{ services: Service[] }>(`/v1/agent-deployments/${enc(id)}/services`, signal), [id], 3000);
  const [error, run] = useAction();
  return (
    <Section
      title={
        <>
          <a href={href("deployments")}>Deployments</a> / {dep.data?.name ?? id}
        </>
      }
    >
      <ErrorNote error={dep.error ?? services.error ?? error} />
      {services.data && services.data.services.length === 0 ? <Empty title="No services running for this deployment" /> : null}
      {services.data && services.data.services.length > 0 ? (
        <table class="list" aria-label="Services">
          <thead>
            <tr>
              <th>Service</th>
              <th>Status</th>
              <th>Machine</th>
              <th>Port</th>
              <th>Public URL</th>
              <th>Up</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {services.data.services.map((s) => (
              <tr>
                <td>{s.id}</td>
                <td>
                  <Status value={s.status} />
                  {s.failure_reason ? <span class="error"> {s.failure_reason}</span> : null}
                </td>
                <td>
                  <a href={href("machines", s.machine_id)}>{s.machine_id}</a>
                </td>
                <td>{s.port}</td>
                <td>
                  {s.public_url ? (
                    <a href={s.public_url} target="_blank" rel="noopener noreferrer">
                      open
                    </a>
                  ) : (
                    "—"
                  )}
                </td>
                <td>{age(s.started_at)}</td>
                <td class="row-actions">
                  <ConfirmButton
                    label="Restart"
                    confirm="Really restart?"
                    onConfirm={() => run(async () => (await api("POST", `/v1/agent-deployments/${enc(id)}/services/${enc(s.id)}/restart`, { reason: "console" }), services.reload()))}
                  />
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : null}
    </Section>
  );
}

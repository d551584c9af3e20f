// Volumes: list, create (name, size), delete (refused by the server while a live machine mounts one).

import { useState } from "preact/hooks";
import { api, enc, get } from "../api.ts";
import { age, ConfirmButton, Empty, ErrorNote, Section, Status, useAction, useLoad } from "../ui.tsx";

interface Volume {
  id: string;
  name: string;
  size_mb: number;
  status: string;
  created_at: string;
}

export function Volumes() {
  const list = useLoad((signal) => get<{ volumes: Volume[] }>("/v1/volumes?limit=100", signal), []);
  const [name, setName] = useState("");
  const [size, setSize] = useState("");
  const [error, run, busy] = useAction();
  const volumes = list.data?.volumes ?? [];
  return (
    <>
      <form
        class="inline-form"
        aria-label="Create a volume"
        onSubmit={(e) => {
          e.preventDefault();
          void run(async () => {
            await api("POST", "/v1/volumes", { name: name.trim(), ...(size ? { size_mb: Number(size) } : {}) });
            setName("");
            list.reload();
          });
        }}
      >
        <label>
          Name
          <input value={name} required pattern="[A-Za-z0-9][A-Za-z0-9._\-]*" onInput={(e) => setName((e.target as HTMLInputElement).value)} />
        </label>
        <label>
          Size (MiB)
          <input type="number" min={1} placeholder="default" value={size} onInput={(e) => setSize((e.target as HTMLInputElement).value)} />
        </label>
        <button type="submit" disabled={busy}>
          Create volume
        </button>
        <ErrorNote error={error} />
      </form>
      <Section title="Volumes">
        <ErrorNote error={list.error} />
        {list.data && volumes.length === 0 ? (
          <Empty title="No volumes yet">
            <p>A volume is a disk that outlives machines and can be shared between them: create one above, then mount it when creating a machine (<code>volumes: [{"{"}volume_id, path{"}"}]</code>).</p>
          </Empty>
        ) : (
          <table class="list" aria-label="Volumes">
            <thead>
              <tr>
                <th>Volume</th>
                <th>Status</th>
                <th>Size</th>
                <th>Age</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {volumes.map((v) => (
                <tr>
                  <td>
                    {v.name} <span class="muted">{v.id}</span>
                  </td>
                  <td>
                    <Status value={v.status} />
                  </td>
                  <td>{v.size_mb} MiB</td>
                  <td>{age(v.created_at)}</td>
                  <td class="row-actions">
                    <ConfirmButton label="Delete" confirm="Really delete?" onConfirm={() => run(async () => (await api("DELETE", `/v1/volumes/${enc(v.id)}`), list.reload()))} />
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
      </Section>
    </>
  );
}

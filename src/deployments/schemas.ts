// What a client may send to create, update and restart deployments: each TypeBox schema is the route's validator and
// the service's input type at once (snake_case as on the wire).

import { Type } from "typebox";
import type { Static } from "typebox";

const Port = Type.Integer({ minimum: 1, maximum: 65535 });
const EnvName = "^[A-Za-z_][A-Za-z0-9_]*$";
const Envs = Type.Record(Type.String({ pattern: EnvName }), Type.String({ maxLength: 131072 }), { maxProperties: 256 });

export const Readiness = Type.Object(
  {
    path: Type.Optional(Type.String({ minLength: 1, maxLength: 2048, pattern: "^/[^\\s]*$", description: "HTTP path to GET; without it the probe is TCP" })),
    interval_s: Type.Optional(Type.Number({ minimum: 0.1, maximum: 3600 })),
    timeout_s: Type.Optional(Type.Number({ minimum: 0.1, maximum: 600 })),
  },
  { additionalProperties: false },
);

const Name = Type.String({ minLength: 1, maxLength: 128 });
const Template = Type.String({ minLength: 1, maxLength: 256 });
const Command = Type.String({ minLength: 1, maxLength: 131072, description: "Shell line run by /bin/sh -c as the machine's user, in /workspace" });
const Replicas = Type.Integer({ minimum: 1, maximum: 32 });

export const CreateDeployment = Type.Object(
  {
    name: Name,
    template: Template,
    command: Command,
    port: Port,
    envs: Type.Optional(Envs),
    replicas: Type.Optional(Replicas),
    public_url: Type.Optional(Type.Boolean({ description: "Whether ready services get a public edge URL (default true)" })),
    readiness: Type.Optional(Readiness),
  },
  { additionalProperties: false },
);

export const UpdateDeployment = Type.Object(
  {
    name: Type.Optional(Name),
    template: Type.Optional(Template),
    command: Type.Optional(Command),
    port: Type.Optional(Port),
    envs: Type.Optional(Envs),
    replicas: Type.Optional(Replicas),
    public_url: Type.Optional(Type.Boolean()),
    readiness: Type.Optional(Readiness),
  },
  { additionalProperties: false, minProperties: 1 },
);

export const RestartRequest = Type.Object(
  {
    reason: Type.Optional(Type.String({ maxLength: 1024 })),
    envs: Type.Optional(Type.Record(Type.String({ pattern: EnvName }), Type.String({ maxLength: 131072 }), { maxProperties: 256, description: "Request-only runtime envs (string values only); never stored" })),
  },
  { additionalProperties: false },
);


export type ReadinessInput = Static<typeof Readiness>;
export type CreateDeploymentInput = Static<typeof CreateDeployment>;
export type UpdateDeploymentInput = Static<typeof UpdateDeployment>;
export type RestartInput = Static<typeof RestartRequest>;

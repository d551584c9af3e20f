// What a client may send to create, update and restart deployments: each TypeBox schema is the route's validator and
// the service's input type at once (snake_case as on the wire).

import { Type } from "typebox";
import type { Static } from "typebox";

const Port = Type.Integer({ minimum: 1, maximum: 65535 });
const EnvName = "^[A-Za-z_][A-Za-z0-9_]*$";
const Envs = Type.Record(Type.String({ pattern: EnvName }), Type.String({ maxLength: 131072 }), { maxProperties: 256, additionalProperties: false });

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

/** How public URLs are authorised (docs/deployments.md, "Access"). */
export const ACCESS_MODES = ["token", "public", "signed"] as const;
export type AccessMode = (typeof ACCESS_MODES)[number];
const Access = Type.Enum(ACCESS_MODES, {
  description:
    "How the public URLs are authorised: `token` (default) a long-lived token, the same on every read, that rotate-edge-token replaces; " +
    "`public` no credential at all (anyone who learns the URL reaches the service); `signed` a fresh token per read that expires after KILN_EDGE_TOKEN_TTL_S",
});

export const CreateDeployment = Type.Object(
  {
    name: Name,
    template: Template,
    command: Command,
    port: Port,
    envs: Type.Optional(Envs),
    replicas: Type.Optional(Replicas),
    public_url: Type.Optional(Type.Boolean({ description: "Whether ready services get a public edge URL (default true)" })),
    access: Type.Optional(Access),
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
    access: Type.Optional(Access),
    readiness: Type.Optional(Readiness),
  },
  { additionalProperties: false, minProperties: 1 },
);

export const RestartRequest = Type.Object(
  {
    reason: Type.Optional(Type.String({ maxLength: 1024 })),
    envs: Type.Optional(Type.Record(Type.String({ pattern: EnvName }), Type.String({ maxLength: 131072 }), { maxProperties: 256, additionalProperties: false, description: "Request-only runtime envs (string values only); never stored" })),
  },
  { additionalProperties: false },
);


export type ReadinessInput = Static<typeof Readiness>;
export type CreateDeploymentInput = Static<typeof CreateDeployment>;
export type UpdateDeploymentInput = Static<typeof UpdateDeployment>;
export type RestartInput = Static<typeof RestartRequest>;

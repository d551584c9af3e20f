// The uid/gid mapping every machine gets: machine ids 0–65535 are host ids 100000–165535, so machine root is an
// unprivileged host uid. Template layers are written with ownership already in that range.

export const HOST_ID_BASE = 100_000;
export const ID_RANGE = 65_536;

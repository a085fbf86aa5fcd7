"""The trajectory store: every trajectory of a run in one SQLite file (stdlib `sqlite3`).

One row per trajectory. Token ids and policy versions are stored as little-endian int32
blobs and behaviour log-probs as little-endian float64 blobs, so floats round-trip
bit-exactly and a 1k-token response costs ~16 KB. The `Sample` of each trajectory is kept
once per sample id in a side table and rebuilt on load.

The file is opened in WAL mode so a report or dashboard can read while training writes.
Reopening an existing file keeps its data (a resumed run appends); `delete_after(step)`
drops what a crashed run wrote after the checkpoint it resumes from.

Simplification: the partial-rollout pool is not here yet; this is the append-only history.
"""

from __future__ import annotations

import json
import math
import sqlite3
import sys
import threading
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `rollwise.types` imports torch; keep the store importable without it
    from rollwise.types import Group, Sample, Trajectory

SCHEMA_VERSION = 2  # 2: the `advantage` column (a version-1 store gains it on opening)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    sample_id TEXT PRIMARY KEY,
    prompt    TEXT NOT NULL,   -- JSON: a string or a list of chat messages
    answer    TEXT NOT NULL,
    reference TEXT,
    meta      TEXT NOT NULL    -- JSON object
);
CREATE TABLE IF NOT EXISTS trajectories (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    step          INTEGER NOT NULL,
    group_idx     INTEGER NOT NULL,  -- index of the group within its step
    traj_idx      INTEGER NOT NULL,  -- index of the trajectory within its group
    sample_id     TEXT NOT NULL,
    prompt_ids    BLOB NOT NULL,     -- int32 LE [P]
    response_ids  BLOB NOT NULL,     -- int32 LE [T]
    logprobs      BLOB NOT NULL,     -- float64 LE [T]
    versions      BLOB NOT NULL,     -- int32 LE [T]
    num_tokens    INTEGER NOT NULL,  -- T, kept as a column for fast length queries
    finish_reason TEXT NOT NULL,
    text          TEXT NOT NULL,
    reward        REAL,              -- NULL encodes NaN (SQLite stores NaN as NULL)
    reward_info   TEXT NOT NULL,     -- JSON object
    timings       TEXT NOT NULL,     -- JSON object
    advantage     REAL               -- the one the update used; NULL: not trained on
);
-- multi-turn trajectories only (rows of single-turn ones are absent): which response
-- tokens the environment inserted, and the turn records (docs/agents.md)
CREATE TABLE IF NOT EXISTS episodes (
    step          INTEGER NOT NULL,
    group_idx     INTEGER NOT NULL,
    traj_idx      INTEGER NOT NULL,
    loss_mask     BLOB NOT NULL,     -- int32 LE [T]: 1 sampled, 0 inserted
    turns         TEXT NOT NULL,     -- JSON [[start, end], ...]
    turn_rewards  TEXT NOT NULL,     -- JSON [K]
    turn_states   TEXT NOT NULL,     -- JSON [K]
    tree          INTEGER NOT NULL,
    PRIMARY KEY (step, group_idx, traj_idx)
);
CREATE INDEX IF NOT EXISTS traj_step ON trajectories(step, group_idx, traj_idx);
CREATE INDEX IF NOT EXISTS traj_sample ON trajectories(sample_id, step);
"""

_BIG_ENDIAN = sys.byteorder == "big"


def _pack(values: list[int] | list[float], typecode: str) -> bytes:
    """Pack numbers into a little-endian blob (`typecode` "i" int32 or "d" float64)."""
    arr = array(typecode, values)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def _unpack(blob: bytes, typecode: str) -> list:
    """Inverse of `_pack`."""
    arr = array(typecode)
    arr.frombytes(blob)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tolist()


def _json_default(value: Any) -> Any:
    """Make numpy/torch scalars and other stragglers JSON-serialisable."""
    if hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # a multi-element array or tensor
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_json_default, ensure_ascii=False)


class TrajectoryStore:
    """Append-only SQLite history of every trajectory of a run.

    >>> store = TrajectoryStore(":memory:")
    >>> store.count(), store.steps()
    (0, [])
    >>> store.close()
    """

    def __init__(self, path: str | Path) -> None:
        """Open (or create) the store at `path`; ":memory:" gives a throwaway store."""
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # The driver, reward workers and a report reader may share one store object.
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False)
        with self._lock, self._conn:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a committed step survives a power cut too (its checkpoint may follow)
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_SCHEMA)
            found = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if found == 1:  # written before advantages were kept: they read as NULL
                self._conn.execute("ALTER TABLE trajectories ADD COLUMN advantage REAL")
            if found in (0, 1):
                self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif found != SCHEMA_VERSION:
                raise ValueError(
                    f"trajectory store {self.path} has schema version {found}; "
                    f"this rollwise reads version {SCHEMA_VERSION}"
                )

    # -- writing ---------------------------------------------------------------------------

    def add_groups(self, step: int, groups: list[Group]) -> None:
        """Store every trajectory of `groups` under training step `step`, in one transaction.

        Calling it again for the same step appends: group indices continue after the last.
        """
        sample_rows: dict[str, tuple] = {}
        traj_rows: list[tuple] = []
        episode_rows: list[tuple] = []
        with self._lock:
            first = self._conn.execute(
                "SELECT COALESCE(MAX(group_idx) + 1, 0) FROM trajectories WHERE step = ?", (step,)
            ).fetchone()[0]
            for g_off, group in enumerate(groups):
                for t_idx, traj in enumerate(group.trajectories):
                    s = traj.sample
                    sample_rows[s.id] = (
                        s.id,
                        _dumps(s.prompt),
                        s.answer,
                        s.reference,
                        _dumps(s.meta),
                    )
                    traj_rows.append(self._traj_row(step, first + g_off, t_idx, traj))
                    if traj.loss_mask is not None:
                        episode_rows.append((
                            step, first + g_off, t_idx, _pack(traj.loss_mask, "i"),
                            _dumps(traj.turns), _dumps(traj.turn_rewards),
                            _dumps(traj.turn_states), traj.tree))
            with self._conn:
                self._conn.executemany(
                    "INSERT OR REPLACE INTO samples VALUES (?, ?, ?, ?, ?)", sample_rows.values()
                )
                self._conn.executemany(
                    "INSERT INTO trajectories (step, group_idx, traj_idx, sample_id, prompt_ids,"
                    " response_ids, logprobs, versions, num_tokens, finish_reason, text, reward,"
                    " reward_info, timings, advantage)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    traj_rows,
                )
                self._conn.executemany(
                    "INSERT OR REPLACE INTO episodes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    episode_rows)

    @staticmethod
    def _traj_row(step: int, group_idx: int, traj_idx: int, t: Trajectory) -> tuple:
        if not (len(t.response_ids) == len(t.logprobs) == len(t.versions)):
            raise ValueError(
                f"trajectory of sample {t.sample.id!r} (step {step}) has "
                f"{len(t.response_ids)} response ids, {len(t.logprobs)} logprobs and "
                f"{len(t.versions)} versions; all three must have the same length"
            )
        reward = float(t.reward)
        return (
            step,
            group_idx,
            traj_idx,
            t.sample.id,
            _pack(t.prompt_ids, "i"),
            _pack(t.response_ids, "i"),
            _pack([float(x) for x in t.logprobs], "d"),
            _pack(t.versions, "i"),
            len(t.response_ids),
            t.finish_reason,
            t.text,
            None if math.isnan(reward) else reward,  # SQLite would store NaN as NULL anyway
            _dumps(t.reward_info),
            _dumps(t.timings),
            t.advantage,
        )

    def delete_after(self, step: int) -> int:
        """Drop the trajectories of steps > `step` (resume from a checkpoint); return the count."""
        with self._lock, self._conn:
            cur = self._conn.execute("DELETE FROM trajectories WHERE step > ?", (step,))
            self._conn.execute("DELETE FROM episodes WHERE step > ?", (step,))
            return cur.rowcount

    # -- reading ---------------------------------------------------------------------------

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def count(self) -> int:
        """Number of stored trajectories."""
        return self._query("SELECT COUNT(*) FROM trajectories")[0][0]

    def steps(self) -> list[int]:
        """The distinct training steps that have trajectories, ascending."""
        return [r[0] for r in self._query("SELECT DISTINCT step FROM trajectories ORDER BY step")]

    def response_lengths(self, step: int | None = None) -> list[int]:
        """Response lengths in tokens, of one step or (None) of the whole run, in insert order."""
        if step is None:
            rows = self._query("SELECT num_tokens FROM trajectories ORDER BY id")
        else:
            rows = self._query(
                "SELECT num_tokens FROM trajectories WHERE step = ? ORDER BY id", (step,)
            )
        return [r[0] for r in rows]

    def prompt_history(self, sample_id: str) -> list[tuple[int, float]]:
        """(step, reward) of every stored trajectory of one prompt, in step order."""
        rows = self._query(
            "SELECT step, reward FROM trajectories WHERE sample_id = ? ORDER BY step, id",
            (sample_id,),
        )
        return [(s, float("nan") if r is None else r) for s, r in rows]

    def group_rewards(self) -> list[tuple[str, int, list[float]]]:
        """(sample id, step, rewards) of every stored group, in (step, group) order: the
        per-prompt reward history the allocators' posteriors are built from
        (`rollwise.control.PosteriorBook.rebuild`)."""
        rows = self._query(
            "SELECT sample_id, step, group_idx, reward FROM trajectories"
            " ORDER BY step, group_idx, traj_idx"
        )
        out: list[tuple[str, int, list[float]]] = []
        last = None
        for sid, step, g_idx, reward in rows:
            if (step, g_idx) != last:
                out.append((sid, step, []))
                last = (step, g_idx)
            out[-1][2].append(float("nan") if reward is None else reward)
        return out

    def load_step(self, step: int) -> list[Trajectory]:
        """The trajectories of one step, in (group, trajectory) order, rebuilt exactly."""
        return [traj for _, traj in self._load(step)]

    def load_groups(self, step: int) -> list[Group]:
        """The groups of one step, as they were added."""
        from rollwise.types import Group

        groups: list[Group] = []
        last = None
        for g_idx, traj in self._load(step):
            if g_idx != last:
                groups.append(Group(sample=traj.sample, trajectories=[]))
                last = g_idx
            groups[-1].trajectories.append(traj)
        return groups

    def _load(self, step: int) -> list[tuple[int, Trajectory]]:
        """(group index, trajectory) pairs of one step, in (group, trajectory) order."""
        from rollwise.types import Trajectory

        rows = self._query(
            "SELECT t.group_idx, t.sample_id, t.prompt_ids, t.response_ids, t.logprobs,"
            " t.versions, t.finish_reason, t.text, t.reward, t.reward_info, t.timings,"
            " t.advantage,"
            " s.prompt, s.answer, s.reference, s.meta,"
            " e.loss_mask, e.turns, e.turn_rewards, e.turn_states, e.tree"
            " FROM trajectories t JOIN samples s ON s.sample_id = t.sample_id"
            " LEFT JOIN episodes e ON e.step = t.step AND e.group_idx = t.group_idx"
            " AND e.traj_idx = t.traj_idx"
            " WHERE t.step = ? ORDER BY t.group_idx, t.traj_idx",
            (step,),
        )
        samples: dict[str, Sample] = {}
        out: list[tuple[int, Trajectory]] = []
        for (
            g_idx,
            sid,
            p_ids,
            r_ids,
            lps,
            vers,
            finish,
            text,
            reward,
            info,
            timings,
            advantage,
            prompt,
            answer,
            reference,
            meta,
            *episode,
        ) in rows:
            if sid not in samples:
                samples[sid] = self._sample(sid, prompt, answer, reference, meta)
            traj = Trajectory(
                sample=samples[sid],
                prompt_ids=_unpack(p_ids, "i"),
                response_ids=_unpack(r_ids, "i"),
                logprobs=_unpack(lps, "d"),
                versions=_unpack(vers, "i"),
                finish_reason=finish,
                text=text,
                reward=float("nan") if reward is None else reward,
                **dict(zip(("scores", "reward_errors"),
                           Trajectory.split_reward_info(json.loads(info)), strict=True)),
                timings=json.loads(timings),
                advantage=advantage,
            )
            if episode[0] is not None:  # a multi-turn trajectory's layout
                traj.loss_mask = _unpack(episode[0], "i")
                traj.turns = [tuple(x) for x in json.loads(episode[1])]
                traj.turn_rewards, traj.turn_states = json.loads(episode[2]), json.loads(episode[3])
                traj.tree = episode[4]
            out.append((g_idx, traj))
        return out

    @staticmethod
    def _sample(sid: str, prompt: str, answer: str, reference: str | None, meta: str) -> Sample:
        from rollwise.types import Sample

        return Sample(
            id=sid,
            prompt=json.loads(prompt),
            answer=answer,
            reference=reference,
            meta=json.loads(meta),
        )

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._conn.close()

    def __repr__(self) -> str:
        return f"TrajectoryStore({self.path!r})"

"""DCP planners that write and read each rank's chunk of a global tensor.

A global tensor reaches DCP as its plain local tensor plus a :class:`Chunk`
(NOTE [checkpoint chunks]): the save planner turns the chunk into a DCP shard
write item, the load planner into read items against whichever saved chunks
overlap it. Every other value (plain tensors, Python objects) goes through
DCP's default plans: plain tensors and objects are deduplicated across ranks,
so they are written once. The state dicts handed to these planners are
already flat (NOTE [checkpoint keys]).

Imported lazily by ``sbpflow.checkpoint``: DCP costs half a second to import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ._chunks import Chunk

__all__ = ["ChunkLoadPlanner", "ChunkSavePlanner"]


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes ``state_dict[key]`` as the chunk ``chunks[key]`` (None: this rank writes nothing).

    ``sizes`` holds each chunked key's logical shape.
    """

    def __init__(self, chunks: dict[str, Chunk | None], sizes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = chunks
        self._sizes = sizes

    def create_local_plan(self) -> SavePlan:
        plain = {k: v for k, v in self.state_dict.items() if k not in self._chunks}
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        for key, chunk in self._chunks.items():
            if chunk is None:
                continue
            local = self.state_dict[key]
            offsets = torch.Size(chunk.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk.sizes)),
                        properties=TensorProperties.create_from_tensor(local),
                        size=torch.Size(self._sizes[key]),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self._chunks:
            chunk = self._chunks[index.fqn]
            assert chunk is not None and tuple(index.offset or ()) == chunk.offsets, index
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads ``chunks[key]`` of the saved tensor into ``state_dict[key]`` (None: nothing)."""

    def __init__(self, chunks: dict[str, Chunk | None]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        plain = {k: v for k, v in self.state_dict.items() if k not in self._chunks}
        items = list(create_default_local_load_plan(plain, self.metadata, strict=True).items)
        for key, chunk in self._chunks.items():
            if chunk is None:
                continue
            saved = self.metadata.state_dict_metadata[key]
            assert isinstance(saved, TensorStorageMetadata), key  # checked before the load
            wanted = ChunkStorageMetadata(
                offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)
            )
            items.extend(create_read_items_for_chunk_list(key, saved, [wanted]))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._chunks:
            return self.state_dict[index.fqn]  # read offsets are relative to the chunk
        return super().lookup_tensor(index)

"""An image model's image embeddings on one rank: the vision tower (sharded like the text layers) encodes an image
when a prompt chunk first needs it, and the rank keeps the embeddings until the sequence's chunks are past the
image, so chunked prefill may cut through an image without encoding it twice. Every rank sees the same steps, so
every rank encodes the same images in the same order (the tower's all-reduces line up)."""
import numpy as np
import torch

from tpengine.distributed.messages import ImageChunk


class ImageEmbeddings:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.model = model  # its encode_images(pixel_values, grids) -> [tokens of every image, hidden]
        self.device, self.dtype = device, dtype
        self._kept: dict[tuple[int, int], torch.Tensor] = {}  # (sequence, image index) -> its embeddings

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences that left the ranks (finished, aborted or preempted): a preempted one encodes again."""
        if self._kept and seq_ids:
            gone = set(seq_ids)
            self._kept = {key: value for key, value in self._kept.items() if key[0] not in gone}

    def replaced_rows(self, image_rows: list[tuple[int, ImageChunk, int, int, int]]) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
        """(the forward's rows that read image embeddings, those embeddings), encoding the images not kept."""
        self._encode([(seq_id, image) for seq_id, image, *_ in image_rows if (seq_id, image.index) not in self._kept])
        rows, vectors = [], []
        for seq_id, image, row, first, count in image_rows:
            key = (seq_id, image.index)
            rows.append(torch.arange(row, row + count))
            vectors.append(self._kept[key][first:first + count])
            if first + count == image.num_tokens:  # the sequence's chunks are past this image
                del self._kept[key]
        return torch.cat(rows).to(self.device), torch.cat(vectors)

    def _encode(self, images: list[tuple[int, ImageChunk]]) -> None:
        """One pass of the vision tower over every image given."""
        if not images:
            return
        pixels = [np.frombuffer(image.pixel_values, dtype=np.float32) for _, image in images]
        patch_rows = torch.from_numpy(np.concatenate(pixels))
        num_patches = sum(image.grid[0] * image.grid[1] * image.grid[2] for _, image in images)
        patch_rows = patch_rows.view(num_patches, -1).to(self.device, self.dtype)
        embeddings = self.model.encode_images(patch_rows, [tuple(image.grid) for _, image in images])
        sizes = [image.num_tokens for _, image in images]
        assert embeddings.size(0) == sum(sizes), "the tower makes one embedding per placeholder token"
        for (seq_id, image), part in zip(images, embeddings.split(sizes)):
            self._kept[(seq_id, image.index)] = part

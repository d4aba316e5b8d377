"""The GGUF derived-data cache's writes: all or nothing, and two processes starting at once
(the second finds the first's directory in place) end quietly with one whole copy."""

from __future__ import annotations

import logging

from pagedllm.model.gguf.cache import save_atomically


def write_files(contents: str):
    def save(folder: str) -> None:
        import os

        os.makedirs(folder)
        with open(os.path.join(folder, "data"), "w") as file:
            file.write(contents)

    return save


def test_a_cache_written_first_by_another_process_is_kept_without_a_warning(tmp_path, caplog):
    cache_dir = str(tmp_path / "kind" / "digest")
    save_atomically(cache_dir, write_files("first"))
    with caplog.at_level(logging.WARNING):
        save_atomically(cache_dir, write_files("second"))  # the rename finds it non-empty
    assert (tmp_path / "kind" / "digest" / "data").read_text() == "first"
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert [p.name for p in (tmp_path / "kind").iterdir()] == ["digest"]  # no staging left


def test_a_cache_that_cannot_be_written_is_warned_about(tmp_path, caplog):
    def fails(folder: str) -> None:
        raise PermissionError("read-only")

    with caplog.at_level(logging.WARNING):
        save_atomically(str(tmp_path / "kind" / "digest"), fails)
    assert "could not write the cache" in caplog.text

"""Metrics output: JSON lines, TensorBoard events, progress bar vs plain log lines."""

import io
import math

from jaxdist.train import MetricsLogger, read_metrics


def test_jsonl_tensorboard_and_log_lines(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=20, stream=out)
    logger.write("train", 10, epoch=0, loss=0.5, accuracy=0.75, examples_per_sec=100.0)
    logger.write("validation", 10, epoch=1, loss=math.nan, accuracy=0.5)
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["event"] for r in records] == ["train", "validation"]
    assert records[0]["loss"] == 0.5 and records[1]["loss"] == "nan"
    # Each phase in its own directory under the same tag: TensorBoard overlays them.
    for phase in ("train", "validation"):
        events = [p for p in (tmp_path / phase).iterdir()
                  if p.name.startswith("events.out.tfevents")]
        assert len(events) == 1
        assert b"accuracy" in events[0].read_bytes()
    assert not list(tmp_path.glob("events.out.tfevents*"))
    assert "[train] step 10 epoch=0 loss=0.5 accuracy=0.75" in out.getvalue()


def test_progress_bar_and_disabled_logger(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(None, total_steps=4, progress_bar="always", stream=out)
    logger.advance(2)
    logger.write("train", 2, loss=1.25, examples_per_sec=10.0)
    logger.advance(2)
    logger.close()
    assert "4/4" in out.getvalue() and "loss=1.25" in out.getvalue()
    quiet = MetricsLogger(tmp_path / "q", enabled=False, stream=out)
    quiet.write("train", 1, loss=1.0)
    quiet.close()
    assert not (tmp_path / "q").exists()

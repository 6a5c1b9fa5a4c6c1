"""The run-directory check's pieces: where the token goes while the run directory does not exist yet, which
hosts are blind, and the line."""
from pathlib import Path

from scaletrain.engine.shared_dir import blind_hosts, blind_line, nearest_existing, sees


def test_the_token_goes_in_the_nearest_existing_parent_so_nothing_is_created(tmp_path):
    assert nearest_existing(tmp_path / "runs" / "a" / "b") == tmp_path
    (tmp_path / "runs").mkdir()
    assert nearest_existing(tmp_path / "runs" / "a") == tmp_path / "runs"
    assert nearest_existing(tmp_path / "runs") == tmp_path / "runs"
    assert not (tmp_path / "runs" / "a").exists()


def test_sees_only_the_same_content(tmp_path):
    t = tmp_path / "tok"
    assert not sees(t, "abc")
    t.write_text("abc")
    assert sees(t, "abc") and not sees(t, "abd")


def test_the_line_names_each_blind_host_and_its_ranks():
    results = [("host0", True), ("host0", True), ("host1", False), ("host1", False), ("host2", False)]
    blind = blind_hosts(results)
    assert blind == {"host1": [2, 3], "host2": [4]}
    line = blind_line(Path("/runs/x"), "host0", blind)
    assert line.startswith("train.out_dir /runs/x is not the same directory on every host: host1 (ranks 2, 3), "
                           "host2 (rank 4) cannot see a file host0 (rank 0) wrote there;")
    assert "filesystem every host mounts" in line and "nothing was written" in line
    assert blind_hosts([("h", True), ("h", True)]) == {}

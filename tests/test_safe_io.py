"""The restricted pickle loader and atomic writes."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from pipefisher.errors import InputError
from pipefisher.safe_io import dump_pickle_atomic, load_pickle, load_yaml, loads_restricted, write_atomic


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_plain_data_and_numpy_scalars_load(protocol: int) -> None:
    obj = {"call_forward": [(np.int64(5), np.int64(9)), (1.5, None)], "x": [np.float64(2.5), np.int32(3)]}
    back = loads_restricted(pickle.dumps(obj, protocol=protocol))
    assert back == obj
    assert isinstance(back["call_forward"][0][0], np.int64)


class Evil:
    def __reduce__(self):  # noqa: D105 - runs os.system when unpickled by an unrestricted loader
        return (os.system, ("touch /tmp/pipefisher-pwned",))


def test_code_in_a_pickle_is_refused_before_it_runs(tmp_path) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"call_forward": Evil()}))
    marker = "/tmp/pipefisher-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    with pytest.raises(InputError, match="refused: the pickle refers to .*system"):
        load_pickle(path)
    assert not os.path.exists(marker)


def test_numpy_arrays_and_object_dtypes_are_refused(tmp_path) -> None:
    path = tmp_path / "arr.pickle"
    path.write_bytes(pickle.dumps({"a": np.arange(3)}))
    with pytest.raises(InputError, match="refused"):
        load_pickle(path)
    with pytest.raises(pickle.UnpicklingError):
        loads_restricted(pickle.dumps(np.array([1], dtype=object)[0:1]))


def test_truncated_empty_and_missing_files(tmp_path) -> None:
    good = pickle.dumps({"a": [(1, 2)] * 50})
    (tmp_path / "cut.pickle").write_bytes(good[: len(good) // 2])
    (tmp_path / "empty.pickle").write_bytes(b"")
    (tmp_path / "text.pickle").write_bytes(b"hello, not a pickle")
    for name, message in [("cut.pickle", "truncated|not a valid pickle"), ("empty.pickle", "empty"),
                          ("text.pickle", "not a valid pickle|truncated"), ("missing.pickle", "no such file")]:
        with pytest.raises(InputError, match=message) as err:
            load_pickle(tmp_path / name)
        assert str(err.value).startswith(str(tmp_path / name))


def test_atomic_write_keeps_old_file_when_serialisation_fails(tmp_path) -> None:
    path = tmp_path / "out.pickle"
    dump_pickle_atomic(path, [[["-- start --"]]])
    with pytest.raises(Exception):
        dump_pickle_atomic(path, [lambda: None])  # not picklable
    assert load_pickle(path) == [[["-- start --"]]]
    assert [p.name for p in tmp_path.iterdir()] == ["out.pickle"]  # no temp file left behind


def test_atomic_write_into_missing_folder_is_an_input_error(tmp_path) -> None:
    with pytest.raises(InputError, match="folder does not exist"):
        write_atomic(tmp_path / "nope" / "x.json", "{}")


@pytest.mark.parametrize("text, where", [
    ("name: x\nmodel: {a: 1\n", "line 3, column 1: expected ',' or '}', but got '<stream end>' "
                                 "(while parsing a flow mapping from line 2, column 8)"),
    ("a: b: c\n", "line 1, column 5: mapping values are not allowed here"),
    ("a: \"\x00\"\n", "unacceptable character #x0000"),
])
def test_a_yaml_syntax_error_is_one_line_with_the_file_line_column_and_problem(tmp_path, text, where) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_yaml(path)
    assert str(err.value).startswith(f"{path}: is not valid YAML: {where}") and "\n" not in str(err.value)

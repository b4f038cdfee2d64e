import pytest

from tests.train.helpers import make_cifar_tree


@pytest.fixture(scope="session")
def cifar_tree(tmp_path_factory):
    return make_cifar_tree(tmp_path_factory.mktemp("cifar"))

import hotlock


def test_lock_and_unlock(cache: hotlock.Cache) -> None:
    lock = cache.lock("smoke", ttl=5)
    assert lock.unlock() is True

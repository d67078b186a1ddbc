import gc, asyncio, pytest
async def test_zz_no_pending_tasks_left() -> None:
    found = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, c: found.append(c))
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect(); gc.collect()
    loop.set_exception_handler(None)
    assert not found, found

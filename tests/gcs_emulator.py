"""`python tests/gcs_emulator.py PORT`: gcp-storage-emulator on 127.0.0.1:PORT, in memory.

Two fixes on top, to what tensorstore's GCS driver relies on:
- the emulator sends no `x-goog-generation` header with an object's data, and tensorstore needs
  it (OCDBT manifests are updated conditionally on the generation read, and fail with
  "Malformed StorageGeneration" without it);
- the emulator ignores a listing's `startOffset` / `endOffset` and returns every object of the
  bucket; tensorstore lists a key range with them (and its `delete_range` deletes whatever the
  listing returns), so the listing is restricted to that range here, as GCS does.
- the emulator has no `objects.move` (`.../o/NAME/moveTo/o/NEW`, what gcsfs's `mv`, hence
  etils.epath's `rename` and `replace`, calls first): here it copies, then deletes the source.
The emulator still ignores preconditions (`ifGenerationMatch`), so it cannot show that
concurrent writers are refused.
"""

from http import HTTPStatus
import sys
import threading

from gcp_storage_emulator.handlers import objects

_download = objects.download
_ls = objects.ls


def _download_with_generation(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    response['x-goog-generation'] = str(obj['generation'])
  except Exception:  # pylint: disable=broad-except  (a missing object: the handler says 404)
    pass
  return _download(request, response, storage, *args, **kwargs)


def _ls_in_range(request, response, storage, *args, **kwargs):
  start = (request.query.get('startOffset') or [''])[0]
  end = (request.query.get('endOffset') or [''])[0]
  send = response.json

  def in_range(listing):
    listing['items'] = [o for o in listing.get('items') or []
                        if start <= o['name'] and (not end or o['name'] < end)]
    send(listing)

  response.json = in_range
  return _ls(request, response, storage, *args, **kwargs)


objects.download = _download_with_generation   # before the server module builds its routes
objects.ls = _ls_in_range

from gcp_storage_emulator import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    server as _server, settings)


def _move(request, response, storage, *args, **kwargs):
  """objects.move within a bucket: a copy, then the source deleted."""
  request.params['dest_bucket_name'] = request.params['bucket_name']
  objects.copy(request, response, storage, *args, **kwargs)
  if response.status == HTTPStatus.OK:
    source = request.params['bucket_name'], request.params['object_id']
    objects._delete(storage, *source)  # pylint: disable=protected-access


_server.HANDLERS = tuple(
    (rf'^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/'
     rf'(?P<dest_object_id>.*[^/]+)$', {_server.POST: _move})
    for prefix in (settings.API_ENDPOINT, '')) + _server.HANDLERS


if __name__ == '__main__':
  server = _server.create_server('127.0.0.1', int(sys.argv[1]), in_memory=True)
  server.start()
  threading.Event().wait()

# cython: language_level=3, boundscheck=False, wraparound=False
"""The garbage collector and the loop's long lists: :func:`untrack_plain`.

A tracked list is traversed item by item (a cache miss each) by every collection of the
generation it is in while it lives; a request's 100 k decoded keys or sizes cost each
young collection ~1-3 ms of CPU on this VM. A list of objects of types the collector
never tracks (bytes, str, int, float, bool, None, kvshm._index.Entry) is in no cycle the
collector could free, so taking it off the collector's lists changes nothing it frees.
Off switch: ``KVSHM_UNTRACK=0`` (read at import by its callers) leaves every list tracked.
"""

from cpython.object cimport PyObject, PyTypeObject


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void *op)
    void PyObject_GC_Track(void *op)
    int PyObject_GC_IsTracked(object op)
    Py_ssize_t PyList_GET_SIZE(object o)
    PyObject* PyList_GET_ITEM(object o, Py_ssize_t i)
    PyTypeObject* Py_TYPE(PyObject* o)
    int PyType_HasFeature(PyTypeObject* t, unsigned long feature)
    unsigned long Py_TPFLAGS_HAVE_GC


def untrack_plain(list lst, Py_ssize_t start=0):
    """Take ``lst`` off the garbage collector's lists when no item from ``start`` on is
    of a type the collector tracks (``Py_TPFLAGS_HAVE_GC`` unset: bytes, str, int,
    float, bool, None, :class:`kvshm._index.Entry`); True if ``lst`` is untracked now.
    Otherwise (an item of a tracked type) ``lst`` is tracked (again, if it was not) and
    False returned. ``start``: the items before it were checked by the call that
    untracked ``lst`` (a list untracked empty and grown since); ignored while ``lst`` is
    tracked (every item checked then). Such a list is in no cycle the collector could free (it
    sees no reference out of those items), so untracking it changes nothing collected;
    a tracked one is traversed item by item (a cache miss each) by every collection of
    its generation while it lives: a request's 100 k keys, sizes or entries cost each
    young collection ~1-3 ms CPU on this VM. The items are not changed. Were an object
    of a tracked type appended to an untracked list later, only a cycle through it would
    go uncollected (reference counting frees everything as ever otherwise): callers
    untrack lists that only ever get such items (:func:`~kvshm.zmq_ctrl.protocol.
    decode_request`, :class:`~kvshm.zmq_ctrl.protocol.RequestDecoder`: a request's
    decoded lists; :class:`kvshm.store.sessions._Grant`: a grant's entries)."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(lst)
    if start < 0 or PyObject_GC_IsTracked(lst):
        start = 0
    for i in range(start, n):
        if PyType_HasFeature(Py_TYPE(PyList_GET_ITEM(lst, i)), Py_TPFLAGS_HAVE_GC):
            if not PyObject_GC_IsTracked(lst):
                PyObject_GC_Track(<void*>lst)
            return False
    if PyObject_GC_IsTracked(lst):
        PyObject_GC_UnTrack(<void*>lst)
    return True

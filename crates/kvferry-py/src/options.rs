//! `EngineOptions`: everything an engine is started with, as one object — a thin
//! wrapper over the library's [`kvferry::engine::EngineOptions`], where each option's
//! name, type, default and documentation are declared once.
//!
//! `kvferry.Engine` passes its keyword arguments to `EngineOptions(**kwargs)`, which
//! deserializes them into the library's type (an unknown name or a value of the wrong
//! type is an `InvalidArgumentError` naming it); checking the values is the library's
//! (`EngineOptions::to_config`, at engine start). `EngineOptions.defaults()` returns the
//! library's defaults, which the package's tests compare with `kvferry.Engine`'s
//! keyword defaults.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use crate::errors::ErrInfo;

/// Everything `_kvferry.Engine` is started with (see `kvferry.Engine` for each field).
#[pyclass(name = "EngineOptions", module = "kvferry._kvferry", frozen)]
#[derive(Clone, Debug)]
pub struct PyEngineOptions {
    /// The library's options.
    pub inner: kvferry::engine::EngineOptions,
}

#[pymethods]
impl PyEngineOptions {
    /// Options with the library's defaults; any option may be given as a keyword.
    #[new]
    #[pyo3(signature = (**kwargs))]
    fn new(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<PyEngineOptions> {
        let Some(d) = kwargs else {
            return Ok(PyEngineOptions {
                inner: kvferry::engine::EngineOptions::default(),
            });
        };
        // Python's bool is an int: refuse it where the option is not a switch, as a
        // typo'd `wait_spin_us=True` is not one microsecond.
        let defaults = to_py(d.py(), &kvferry::engine::EngineOptions::default())?;
        for (name, value) in d.iter() {
            if value.is_instance_of::<PyBool>() {
                let switch = defaults
                    .get_item(&name)
                    .ok()
                    .is_some_and(|v| v.is_instance_of::<PyBool>());
                if !switch {
                    return Err(ErrInfo::invalid(format!("{name}: expected a number, got {value}")).into());
                }
            }
        }
        let mut de = pythonize::Depythonizer::from_object(d.as_any());
        // The path names the option a bad value was given for.
        let inner = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let name = e.path().to_string();
            PyErr::from(ErrInfo::invalid(format!("{name}: {}", e.into_inner())))
        })?;
        Ok(PyEngineOptions { inner })
    }

    /// The library's defaults, `{name: value}` (durations in seconds).
    #[staticmethod]
    fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        to_py(py, &kvferry::engine::EngineOptions::default())
    }

    /// These options, `{name: value}` (durations in seconds; the secret hidden).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut shown = self.inner.clone();
        if shown.secret.is_some() {
            shown.secret = Some(b"<hidden>".to_vec());
        }
        to_py(py, &shown)
    }

    fn __repr__(&self) -> String {
        let o = &self.inner;
        format!(
            "EngineOptions(listen={:?}, device={:?}, peer_id={:?}, secret={}, tls={}, arena_bytes={}, etcd={:?}, role={:?})",
            o.listen,
            o.device,
            o.peer_id,
            if o.secret.is_some() { "<hidden>" } else { "None" },
            o.tls_cert.is_some(),
            o.arena_bytes,
            o.etcd,
            o.role,
        )
    }
}

fn to_py<'py>(py: Python<'py>, o: &kvferry::engine::EngineOptions) -> PyResult<Bound<'py, PyAny>> {
    pythonize::pythonize(py, o).map_err(|e| PyErr::from(ErrInfo::invalid(format!("engine options: {e}"))))
}

# Install rules: headers, the shared and static library, a CMake package
# (find_package(kvferry): kvferry::kvferry, kvferry::kvferry_static) and a
# pkg-config file (kvferry.pc). Both are relocatable: they find the prefix
# from their own location, so `cmake --install build --prefix DIR` works for
# any DIR, and the installed tree can be moved afterwards.
#
# The build tree is a package too (the end of this file): kvferryConfig.cmake
# and kvferry-uninstalled.pc at its top. The install's own versions of those
# files are staged in _kvf_staged, where neither find_package nor pkg-config
# looks, so they are never taken for the build tree's.
include(CMakePackageConfigHelpers)
set(_kvf_staged "${PROJECT_BINARY_DIR}/CMakeFiles/kvferry-install")

set(KVF_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvferry" CACHE STRING
    "Where kvferryConfig.cmake goes, relative to the prefix")
set(KVF_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig" CACHE STRING
    "Where kvferry.pc goes, relative to the prefix")

# Installed programs find the installed libkvferry.so relative to themselves,
# whatever the prefix.
if(NOT IS_ABSOLUTE "${CMAKE_INSTALL_BINDIR}" AND NOT IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  file(RELATIVE_PATH _kvf_bin_to_lib "/kvf/${CMAKE_INSTALL_BINDIR}" "/kvf/${CMAKE_INSTALL_LIBDIR}")
  set(_kvf_install_rpath "$ORIGIN/${_kvf_bin_to_lib}")
else()
  set(_kvf_install_rpath "${CMAKE_INSTALL_FULL_LIBDIR}")
endif()
foreach(_kvf_prog kvferry kvferryd)
  if(TARGET ${_kvf_prog})
    set_property(TARGET ${_kvf_prog} PROPERTY INSTALL_RPATH "${_kvf_install_rpath}")
  endif()
endforeach()

install(TARGETS kvferry_shared kvferry_static
  EXPORT kvferryTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Public headers only: internal ones live next to the sources, not here.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/kvferry
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/kvferry/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvferry)

install(EXPORT kvferryTargets
  NAMESPACE kvferry::
  FILE kvferryTargets.cmake
  DESTINATION ${KVF_INSTALL_CMAKEDIR})

# What the package config needs to find the static library's dependencies.
set(KVF_PACKAGE_WITH_CUDA ${KVF_WITH_CUDA})
set(KVF_PACKAGE_CUDA_ROOT "")
if(KVF_WITH_CUDA AND DEFINED CUDAToolkit_LIBRARY_ROOT)
  set(KVF_PACKAGE_CUDA_ROOT "${CUDAToolkit_LIBRARY_ROOT}")
endif()
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/kvferryConfig.cmake.in
  ${_kvf_staged}/kvferryConfig.cmake
  INSTALL_DESTINATION ${KVF_INSTALL_CMAKEDIR})
# Until 1.0 a minor release may break the API: only the same minor matches.
# The same file serves the build tree and the install.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/kvferryConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${_kvf_staged}/kvferryConfig.cmake
  ${PROJECT_BINARY_DIR}/kvferryConfigVersion.cmake
  DESTINATION ${KVF_INSTALL_CMAKEDIR})

# pkg-config: ${pcfiledir}-relative prefix, so the file survives relocation.
if(IS_ABSOLUTE "${KVF_INSTALL_PKGCONFIGDIR}")
  set(KVF_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH _kvf_pc_up "/kvf/${KVF_INSTALL_PKGCONFIGDIR}" "/kvf")
  string(REGEX REPLACE "/$" "" _kvf_pc_up "${_kvf_pc_up}")
  set(KVF_PC_PREFIX "\${pcfiledir}/${_kvf_pc_up}")
endif()
foreach(_kvf_dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${_kvf_dir}}")
    set(KVF_PC_${_kvf_dir} "${CMAKE_INSTALL_${_kvf_dir}}")
  else()
    set(KVF_PC_${_kvf_dir} "\${prefix}/${CMAKE_INSTALL_${_kvf_dir}}")
  endif()
endforeach()
# Static linking needs what the library links privately. jansson, hwloc and libcrypto
# go here as plain -l flags rather than Requires.private: that would make
# `pkg-config --static` demand their own static dependencies (libudev for
# hwloc) even when only libkvferry.a is linked statically.
string(REPLACE ";" " " KVF_PC_LIBS_PRIVATE "${JANSSON_LDFLAGS};${HWLOC_LDFLAGS};${LIBCRYPTO_LDFLAGS}")
string(APPEND KVF_PC_LIBS_PRIVATE " ")
if(KVF_WITH_CUDA)
  get_filename_component(_kvf_cudart_dir "${CUDA_cudart_static_LIBRARY}" DIRECTORY)
  string(APPEND KVF_PC_LIBS_PRIVATE "-L${_kvf_cudart_dir} -lcudart_static -lrt ")
endif()
string(APPEND KVF_PC_LIBS_PRIVATE "-lpthread ")
if(CMAKE_DL_LIBS)
  string(APPEND KVF_PC_LIBS_PRIVATE "-l${CMAKE_DL_LIBS}")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/kvferry.pc.in ${_kvf_staged}/kvferry.pc @ONLY)
install(FILES ${_kvf_staged}/kvferry.pc DESTINATION ${KVF_INSTALL_PKGCONFIGDIR})

# The build tree as a package, for consumers that build against it without
# installing: both name the source include/ and the build include/ (the
# generated version.h), and the libraries where the build left them.
#   find_package(kvferry) with -Dkvferry_DIR=BUILD or BUILD in CMAKE_PREFIX_PATH:
#     the same config file as the install, over the targets exported here;
#   pkg-config with BUILD in PKG_CONFIG_PATH: kvferry-uninstalled.pc, which
#     pkg-config prefers to an installed kvferry.pc found in the same search.
export(EXPORT kvferryTargets NAMESPACE kvferry:: FILE ${PROJECT_BINARY_DIR}/kvferryTargets.cmake)
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/kvferryConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kvferryConfig.cmake
  INSTALL_DESTINATION .
  INSTALL_PREFIX ${PROJECT_BINARY_DIR})
configure_file(${PROJECT_SOURCE_DIR}/cmake/kvferry-uninstalled.pc.in ${_kvf_staged}/kvferry-uninstalled.pc.in @ONLY)
# libdir is where the library is built: a generator expression, so one file
# per configuration with a multi-config generator.
get_property(_kvf_multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
if(_kvf_multi_config)
  set(_kvf_uninstalled_pc "${PROJECT_BINARY_DIR}/$<CONFIG>/kvferry-uninstalled.pc")
else()
  set(_kvf_uninstalled_pc "${PROJECT_BINARY_DIR}/kvferry-uninstalled.pc")
endif()
file(GENERATE OUTPUT "${_kvf_uninstalled_pc}" INPUT ${_kvf_staged}/kvferry-uninstalled.pc.in)

package PVE::Storage::Plugin;

# Stand-in for Proxmox's PVE::Storage::Plugin (pve-storage), for the plugin's tests
# only: the base class a custom plugin derives from, with the defaults the fewerbytes
# plugin does not override. Each dies as a real base method on a storage without a
# path would, so a method the plugin forgot shows up as a failure.

use strict;
use warnings;

# The plugin class of a storage type: what pve-storage's functions call methods on.
sub lookup {
    my ($class, $type) = @_;
    return 'PVE::Storage::Custom::FewerbytesPlugin' if $type eq 'fewerbytes';
    die "unknown storage type '$type'\n";
}

sub volume_rollback_is_possible {
    return 1;
}

sub volume_export_formats {
    return ();
}

sub volume_import_formats {
    return ();
}

sub get_formats {
    my ($class) = @_;
    my $format = $class->plugindata()->{format};
    return { valid => $format->[0], default => $format->[1] };
}

our $AUTOLOAD;

sub AUTOLOAD {
    my $method = $AUTOLOAD =~ s/.*:://r;
    return if $method eq 'DESTROY';
    die "storage definition has no path\n";
}

1;
